"""Training–inference parity of the byte-level MoE model: how far each numerics setting
drifts from a reference, in k3 (the RL pass bar is k3 < 1e-3).

    python -m train.parity                                # CPU: trains `tiny` briefly, xla backend
    python -m train.parity --checkpoint runs/tiny         # a run of `python -m train.main`
    python -m train.parity --checkpoint runs/tiny --backend mosaic   # H100: candidates on the kernels

What it does, with a fixed seed:

1. Loads the model from a `train/` run directory (its latest checkpoint), or trains the
   named config for `--train-steps` steps first (0: the untrained init, for smoke tests).
   Parameters are fp32; every configuration computes in bf16 with top-K routing.
2. Each reference configuration (`REFERENCES`, always on the `xla` backend) samples
   `--prompts` continuations of `--tokens` bytes after prompts of `--prompt-len` bytes
   taken from the validation split, then the reference and every candidate
   (`CANDIDATES`, on `--backend`) score those sequences.
3. `pallas_moe.parity.drift` compares them: k3 and exact KL over the 256-byte vocabulary
   on the generated tokens, and per layer the hidden-state relative error and routing flip
   rate. Noise-floor rows: the reference scored twice, the reference's sampling-time
   log-probabilities against its rescoring, and the first candidate scored twice.

Writes `parity.json` (every number), `parity.md` (the table) and `parity.png` (per-layer
error and flip rate) under `--out` and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

from pallas_moe.numerics import Numerics

# The reference engines: HF's MoE aggregation order, and this library's default.
REFERENCES: dict[str, Numerics] = {
    "hf_order": Numerics(aggregation="bf16_per_expert"),
    "fp32": Numerics(),
}
# One switch at a time against the references.
CANDIDATES: dict[str, Numerics] = {
    "fp32": Numerics(),
    "bf16_per_expert": Numerics(aggregation="bf16_per_expert"),
    "bf16_scores": Numerics(aggregation="bf16_scores"),
    "bf16_per_expert+unfused_swiglu": Numerics(aggregation="bf16_per_expert", fuse_swiglu=False),
    "bf16_per_expert+bf16_router": Numerics(aggregation="bf16_per_expert", router_dtype="bfloat16"),
}
PASS_BAR = 1e-3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, config="tiny", train_steps=300)
    p.add_argument("--backend", default="xla", help="candidates' moe_ffn backend: xla, interpret, mosaic")
    p.add_argument("--prompts", type=int, default=25, help="N prompts")
    p.add_argument("--prompt-len", type=int, default=32, dest="prompt_len", help="bytes per prompt")
    p.add_argument("--tokens", type=int, help="M bytes generated per prompt (default: seq_len - prompt_len)")
    p.add_argument("--candidates", help=f"comma-separated subset of {', '.join(CANDIDATES)}")
    p.add_argument("--references", help=f"comma-separated subset of {', '.join(REFERENCES)}")
    p.add_argument("--exact-math", action="store_true", dest="exact_math",
                   help="candidates' kernels take the SwiGLU's exp in full precision instead of "
                        "the default ex2.approx (KernelConfig.for_shape(..., approx_math=False); "
                        "needs --backend mosaic or interpret)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/parity", help="output directory")
    return p.parse_args(argv)


def add_model_args(p: argparse.ArgumentParser, *, config: str, train_steps: int) -> None:
    """The options `load_model` reads: a run to load, or a config to train first."""
    p.add_argument("--checkpoint", help="a train run directory (holding checkpoints/); default: train one")
    p.add_argument("--config", default=config, help="config to train when no --checkpoint is given")
    p.add_argument("--train-steps", type=int, default=train_steps, dest="train_steps",
                   help="steps to train when no --checkpoint is given (0: untrained init)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field of the model to train (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no training progress bar")


def load_model(args, out_dir: pathlib.Path):
    """(config, params, source description): from --checkpoint, or trained here."""
    from flax import nnx

    from train import checkpoint
    from train.configs import Config, get_config, validate, with_overrides
    from train.main import parse_set
    from train.trainer import build_model, build_optimizer, train

    if args.checkpoint:
        run_dir = pathlib.Path(args.checkpoint)
    else:
        base = get_config(args.config)
        overrides = parse_set(args.set, base)
        if args.train_steps == 0:
            cfg = with_overrides(base, **overrides)
            model = build_model(cfg)
            return cfg, nnx.state(model, nnx.Param), f"untrained {cfg.name} init (seed {cfg.seed})"
        run_dir = out_dir / "model"
        cfg = with_overrides(
            base, **overrides, steps=args.train_steps, out=str(run_dir),
            checkpoint_every=args.train_steps, eval_every=args.train_steps,
            log_every=min(base.log_every, args.train_steps),
        )
        train(cfg, progress=not args.no_progress, plot=False)
    mgr = checkpoint.manager(run_dir / "checkpoints", keep=1_000_000)
    step, meta = checkpoint.read_meta(mgr)
    fields = {f.name for f in dataclasses.fields(Config)}
    cfg = validate(Config(**{k: v for k, v in meta["config"].items() if k in fields}))
    model = build_model(cfg)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    template = {"params": params, "rest": rest, "opt_state": build_optimizer(cfg).init(params)}
    _, state, _ = checkpoint.restore(mgr, template, step)
    return cfg, state["params"], f"{run_dir} step {step} ({cfg.name})"


def scorer(cfg, numerics: Numerics, params, kernel_config=None):
    """Jitted `(params, tokens) -> (logits, hidden [L,N,S,d], sets [L,N,S,E])` and a
    `(params, tokens) -> logits` function for sampling, of the model under `numerics` (and
    `kernel_config` for its MoE kernels)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from pallas_moe.parity import topk_sets
    from train.model import MoETransformer

    model = MoETransformer(cfg, rngs=nnx.Rngs(0), numerics=numerics, kernel_config=kernel_config)
    graphdef, fresh, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.structure(fresh) != jax.tree.structure(params):
        raise ValueError("the checkpoint's parameters do not fit the evaluation model.")

    def logits_fn(params, tokens):
        return nnx.merge(graphdef, params, rest)(tokens)[0]

    @jax.jit
    def score(params, tokens):
        model = nnx.merge(graphdef, params, rest)
        trace: list[dict] = []
        logits, _ = model(tokens, trace=trace)  # [N, S, V]
        hidden = jnp.stack([t["hidden"].astype(jnp.float32) for t in trace])  # [L, N, S, d]
        sets = jnp.stack([
            topk_sets(block.moe, t["moe_input"]).reshape(*tokens.shape, -1)
            for block, t in zip(model.blocks, trace)
        ])  # [L, N, S, E]
        return logits, hidden, sets

    return score, logits_fn


def run(args) -> dict:
    import jax
    import numpy as np

    from pallas_moe.parity import drift, logit_drift, sample_continuations
    from train import data
    from train.configs import ConfigError

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, params, source = load_model(args, out_dir)
    notes = []
    if cfg.routing != "topk":
        notes.append("the model trained with token rounding; it is evaluated with top-K routing "
                     "(token rounding's choices depend on the whole batch, not on a token's prefix).")
    eval_cfg = dataclasses.replace(cfg, dtype="bfloat16", routing="topk")
    names = candidate_names(args)
    num_tokens = args.tokens or cfg.seq_len - args.prompt_len
    if num_tokens < 1:
        raise ConfigError(f"--tokens: seq_len - prompt_len = {num_tokens}; pass --tokens >= 1.")

    _, val_bytes, _ = data.load_split(cfg.val_percent)
    prompts = data.validation_batches(val_bytes, args.prompts, args.prompt_len - 1, 1)[0]  # [N, P]
    key = jax.random.key(args.seed)
    timings: dict[str, float] = {}

    def timed(name, fn, *a):
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn(*a))
        timings[name] = round(time.perf_counter() - t0, 3)
        return result

    results: dict = {
        "model": source, "config": cfg.to_dict(), "eval": "bfloat16 compute, top-K routing",
        "backend": args.backend, "reference_backend": "xla", "device": str(jax.devices()[0]),
        "prompts": args.prompts, "prompt_len": args.prompt_len, "tokens": num_tokens,
        "seed": args.seed, "pass_bar": PASS_BAR, "notes": notes, "references": {},
    }
    cand_cfg = dataclasses.replace(eval_cfg, backend=args.backend)
    kernel_config = None
    if args.exact_math:
        from pallas_moe.kernels import KernelConfig

        kernel_config = KernelConfig.for_shape(cfg.d_model, cfg.d_expert, approx_math=False)
    results["kernel_config"] = (
        "exact math" if args.exact_math else "for_shape defaults (approx_math)"
    )
    cand_scorers = {name: scorer(cand_cfg, CANDIDATES[name], params, kernel_config)[0]
                    for name in names}
    for ref_name in reference_names(args):
        ref_numerics = REFERENCES[ref_name]
        ref_score, ref_logits_fn = scorer(dataclasses.replace(eval_cfg, backend="xla"), ref_numerics, params)
        tokens, sampled_logits = timed(f"sample/{ref_name}", sample_continuations,
                                       ref_logits_fn, params, prompts, num_tokens, key)
        ref = timed(f"score/{ref_name}", ref_score, params, tokens)
        ref_again = ref_score(params, tokens)
        rows = {}

        def compare(a, b):
            return drift(tokens, args.prompt_len, a[0], b[0], ref_hidden=a[1], cand_hidden=b[1],
                         ref_selected=a[2], cand_selected=b[2]).to_dict()

        rows["noise: reference scored twice"] = compare(ref, ref_again)
        # The logits each token was sampled from (one forward per step, later positions
        # still 0) against rescoring the finished sequences: one configuration, other inputs.
        k3_value, kl, max_abs = logit_drift(
            np.asarray(tokens)[:, args.prompt_len:], sampled_logits,
            np.asarray(ref[0])[:, args.prompt_len - 1:-1],
        )
        rows["noise: sampling vs rescoring"] = {
            "k3": k3_value, "kl": kl, "max_abs_logp": max_abs, "hidden_rel_err": [],
            "flip_rate": [], "num_tokens": int(num_tokens * args.prompts),
        }
        for name in names:
            cand = timed(f"score/{name} on {ref_name} samples", cand_scorers[name], params, tokens)
            rows[name] = compare(ref, cand)
            if name == names[0]:
                rows[f"noise: {name} scored twice"] = compare(cand, cand_scorers[name](params, tokens))
        results["references"][ref_name] = {"numerics": dataclasses.asdict(ref_numerics), "rows": rows}
    results["timings_s"] = timings
    results["candidates"] = {n: dataclasses.asdict(CANDIDATES[n]) for n in names}
    (out_dir / "parity.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown_table(results)
    (out_dir / "parity.md").write_text(table)
    plot(results, out_dir / "parity.png")
    results["table"] = table
    return results


def _fmt(v) -> str:
    if v is None:
        return "-"
    return "0" if v == 0 else f"{v:.3g}"


def markdown_table(results: dict) -> str:
    """One table per reference: a row per candidate (and the noise floors)."""
    lines = [
        f"model: {results['model']}; {results['eval']}; candidates on `{results['backend']}` "
        f"(kernels: {results.get('kernel_config', 'for_shape defaults')}), "
        f"references on `xla`; {results['prompts']} prompts x {results['tokens']} tokens "
        f"(prompt {results['prompt_len']} bytes), seed {results['seed']}; device {results['device']}.",
        "",
    ]
    for ref_name, ref in results["references"].items():
        lines += [
            f"Reference `{ref_name}` ({ref['numerics']}):",
            "",
            "| candidate | k3 | exact KL | max abs dlogp | hidden rel. err (per layer) | flip rate (per layer) | k3 < 1e-3 |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in ref["rows"].items():
            per_layer = lambda xs: " / ".join(_fmt(x) for x in xs) or "-"
            lines.append(
                f"| {name} | {_fmt(row['k3'])} | {_fmt(row['kl'])} | {_fmt(row['max_abs_logp'])} | "
                f"{per_layer(row['hidden_rel_err'])} | {per_layer(row['flip_rate'])} | "
                f"{'yes' if row['k3'] < results['pass_bar'] else 'NO'} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> pathlib.Path:
    """Per-layer hidden-state error and flip rate of each candidate, one row per reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    refs = results["references"]
    fig, axes = plt.subplots(len(refs), 2, figsize=(11, 3.6 * len(refs)), squeeze=False)
    for (ref_name, ref), (ax_err, ax_flip) in zip(refs.items(), axes):
        drawn = [(n, r) for n, r in ref["rows"].items() if r["hidden_rel_err"] and not n.startswith("noise")]
        for i, (name, row) in enumerate(drawn):
            layers = list(range(1, len(row["hidden_rel_err"]) + 1))
            label = f"{name} (k3 {_fmt(row['k3'])})"
            # Shrinking markers and dashes keep identical curves visible on top of each other.
            style = {"marker": "os^Dv*"[i % 6], "markersize": 9 - i, "linestyle": ("-", "--", ":")[i % 3]}
            # Exact zeros cannot sit on a log axis: draw them at the bottom edge.
            errs = [max(e, 1e-9) for e in row["hidden_rel_err"]]
            ax_err.plot(layers, errs, label=label, **style)
            ax_flip.plot(layers, row["flip_rate"], label=label, **style)
            ax_err.set_xticks(layers)
            ax_flip.set_xticks(layers)
        ax_err.set_yscale("log")
        ax_err.set_ylim(bottom=5e-10)
        ax_err.set_title(f"hidden-state relative error vs {ref_name} (0 drawn at 1e-9)")
        ax_flip.set_title(f"routing flip rate vs {ref_name}")
        for ax in (ax_err, ax_flip):
            ax.set_xlabel("layer")
            ax.grid(alpha=0.3)
        ax_flip.legend(fontsize=8)
    fig.suptitle(f"{results['model']}: candidates on {results['backend']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def candidate_names(args) -> list[str]:
    return [c.strip() for c in args.candidates.split(",")] if args.candidates else list(CANDIDATES)


def reference_names(args) -> list[str]:
    return [c.strip() for c in args.references.split(",")] if args.references else list(REFERENCES)


def check_args(args) -> str | None:
    """A message naming the bad argument, or None."""
    for flag, names, known in (("--candidates", candidate_names(args), CANDIDATES),
                               ("--references", reference_names(args), REFERENCES)):
        unknown = [c for c in names if c not in known]
        if unknown:
            return f"{flag}: unknown {unknown}; choose from {list(known)}."
    if args.backend not in ("xla", "interpret", "mosaic"):
        return f"--backend must be xla, interpret or mosaic, got {args.backend!r}."
    if args.exact_math and args.backend == "xla":
        return "--exact-math sets the kernels' exp; it needs --backend mosaic or interpret."
    for name in ("prompts", "prompt_len"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}."
    if args.tokens is not None and args.tokens < 1:
        return f"--tokens must be >= 1, got {args.tokens}."
    if args.train_steps < 0:
        return f"--train-steps must be >= 0, got {args.train_steps}."
    if args.checkpoint and not (pathlib.Path(args.checkpoint) / "checkpoints").is_dir():
        return f"--checkpoint {args.checkpoint!r} has no checkpoints/ directory (a train run directory)."
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from train.configs import ConfigError

    try:
        results = run(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(results["table"])
    out = pathlib.Path(args.out)
    print(f"json:  {out / 'parity.json'}\ntable: {out / 'parity.md'}\nplot:  {out / 'parity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
