"""Train the byte-level MoE language model on the Python standard library's source.

    python -m train.main --config tiny                 # CPU, a few minutes
    python -m train.main --config tiny --routing token_rounding --steps 200 --out runs/tr
    python -m train.main --config tiny --resume        # continue from runs/tiny's latest checkpoint
    python -m train.main --config tiny --overwrite     # delete runs/tiny's previous run, start again
    python -m train.main --config small --set devices=0 --set expert_parallel=4   # all local devices
    # N hosts: the same command on each, i = 0..N-1 (devices=0: every device of every host)
    python -m train.main --config small --set devices=0 --set expert_parallel=8 \
        --coordinator host0:1234 --num-processes N --process-id i

Writes metrics (JSONL), orbax checkpoints and a loss-curve PNG under the output directory
(default `runs/<config>/`) and prints where they went. A new run into a directory that
already holds files is refused unless --resume or --overwrite says what to do with it.
"""

from __future__ import annotations

import argparse
import sys

from train.configs import CONFIGS, ConfigError, get_config, with_overrides


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", help=f"named config: {', '.join(CONFIGS)}")
    p.add_argument("--steps", type=int)
    p.add_argument("--out", help="output directory (default runs/<config>)")
    p.add_argument("--routing", help="topk or token_rounding")
    p.add_argument("--rounding", help="token rounding mode: nearest, up, down, stochastic, balance")
    p.add_argument("--tile", type=int, help="GEMM tile height M_tile")
    p.add_argument("--seed", type=int)
    p.add_argument("--backend", help="moe_ffn backend: auto, mosaic, interpret, xla")
    p.add_argument("--lr", type=float)
    p.add_argument("--batch-size", type=int, dest="batch_size")
    p.add_argument("--seq-len", type=int, dest="seq_len")
    p.add_argument("--eval-every", type=int, dest="eval_every")
    p.add_argument("--checkpoint-every", type=int, dest="checkpoint_every")
    p.add_argument("--resume", action="store_true",
                   help="continue from the output directory's newest checkpoint that restores cleanly")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in a non-empty output directory, deleting the previous run's outputs")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any config field, e.g. --set num_experts=16 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    dist = p.add_argument_group(
        "multi-process", "run one process per host (or per GPU) with the same command; see the README"
    )
    dist.add_argument("--coordinator", help="host:port of process 0 (enables jax.distributed)")
    dist.add_argument("--num-processes", type=int, dest="num_processes")
    dist.add_argument("--process-id", type=int, dest="process_id")
    dist.add_argument("--cpu-collectives", default="gloo", dest="cpu_collectives",
                      help="CPU collectives backend for multi-process CPU runs (default gloo)")
    return p.parse_args(argv)


def parse_set(items: list[str], base) -> dict:
    import dataclasses

    types = {f.name: type(getattr(base, f.name)) for f in dataclasses.fields(base)}
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects FIELD=VALUE, got {item!r}.")
        key, value = item.split("=", 1)
        if key not in types:
            raise ConfigError(f"unknown config field {key!r} in --set; fields are {sorted(types)}.")
        kind = types[key]
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                out[key] = value.lower() in ("true", "1")
            else:
                out[key] = kind(value)
        except ValueError:
            raise ConfigError(f"{key} must be of type {kind.__name__}, got {value!r}.") from None
    return out


def config_from_args(args: argparse.Namespace):
    base = get_config(args.config)
    overrides = parse_set(args.set, base)
    for key in ("steps", "out", "routing", "rounding", "tile", "seed", "backend", "lr", "batch_size", "seq_len",
                "eval_every", "checkpoint_every"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    return with_overrides(base, **overrides)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2

    if args.resume and args.overwrite:
        print("error: --resume and --overwrite exclude each other.", file=sys.stderr)
        return 2
    if cfg.expert_parallel > 1 and cfg.dispatch == "ragged_all_to_all":
        # Before JAX starts its GPU backend: XLA's default GPU collective is 30-100x slower.
        from pallas_moe.nn.expert_parallel import use_fast_ragged_all_to_all

        use_fast_ragged_all_to_all()
    if args.coordinator:
        if args.num_processes is None or args.process_id is None:
            print("error: --coordinator needs --num-processes and --process-id", file=sys.stderr)
            return 2
        from train import distributed

        distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.cpu_collectives)

    from train.checkpoint import CheckpointError
    from train.trainer import RunDirError, train

    print(f"config {cfg.name}: d={cfg.d_model} layers={cfg.num_layers} E={cfg.num_experts} "
          f"K={cfg.top_k} n={cfg.d_expert} seq={cfg.seq_len} batch={cfg.batch_size} "
          f"routing={cfg.routing}" + (f"/{cfg.rounding} tile={cfg.tile}" if cfg.routing == "token_rounding" else "")
          + f" steps={cfg.steps}", flush=True)
    try:
        result = train(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # the run diverged; the message names the step
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, CheckpointError) as e:
        if not args.resume:
            raise
        print(f"error: --resume: {e}", file=sys.stderr)
        return 2
    if result.nothing_to_do:
        print(f"nothing to do: {result.nothing_to_do}; no file was changed.")
        return 0
    val = ", ".join(f"{k}={v:.4f}" for k, v in result.final_val.items())
    print(f"done: step {result.final_step}, {val}, {result.train_tokens_per_s:,.0f} train tokens/s")
    print(f"metrics:    {result.metrics_path}")
    print(f"checkpoint: {result.checkpoint_path}")
    print(f"plot:       {result.plot_path}")
    print(f"summary:    {result.out_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
