"""The training loop: AdamW with warmup + cosine, jitted steps, validation, JSONL metrics,
orbax checkpoints with exact resume, and a loss-curve plot.

The model is split once into a static graph and two pytrees, `params` (nnx.Param) and
`rest` (any other state, such as RNG streams); the train step is a pure `jax.jit` function
of `(params, rest, opt_state, batch)`. Everything a run needs to continue bit-exactly lives
in the checkpoint: params, rest, optimizer state, step and the data loader's position.

A run is never destroyed silently: a new run into a directory that already holds files is
refused unless `overwrite=True` (`--overwrite`); resume falls back past damaged checkpoints
and drops a torn last metrics line, saying so on stderr; resuming a finished run changes
nothing; a non-finite loss or gradient norm stops the run before any checkpoint of it is
written, naming the first bad step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pallas_moe.ops.moe_ffn import resolve_backend
from train import checkpoint, data, distributed
from train.configs import Config, ConfigError, validate
from train.model import MoETransformer

# Routing statistics logged per step (summed over layers for row counts, averaged otherwise).
# nonfinite_tokens: tokens whose router logits held NaN/Inf (0 in a healthy step).
ROW_STATS = ("dropped_rows", "added_rows", "padding_rows", "tc_padding_rows", "nonfinite_tokens")
FRACTION_STATS = ("padding_fraction", "tc_padding_fraction", "max_load")


def build_model(cfg: Config, seed: int | None = None, mesh=None) -> MoETransformer:
    """The model; with a mesh (`distributed.make_mesh`), its MoE layers are expert-parallel."""
    ep = None
    if mesh is not None:
        import pallas_moe as pm

        ep = pm.nn.ExpertParallel(
            mesh, axis="expert", dispatch=cfg.dispatch, overlap=cfg.overlap, num_chunks=cfg.num_chunks
        )
    return MoETransformer(cfg, rngs=nnx.Rngs(cfg.seed if seed is None else seed), expert_parallel=ep)


def lr_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `lr * final_lr_fraction`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps,
        end_value=cfg.lr * cfg.final_lr_fraction,
    )


def build_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW; no weight decay on vectors (norm scales)."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy in nats. logits f32[B, S, V], targets i32[B, S]."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def routing_summary(aux: dict) -> dict[str, jax.Array]:
    """Scalars from the model's aux: row counts summed over layers, fractions averaged."""
    out = {}
    for key in ROW_STATS:
        if key in aux:
            out[key] = jnp.sum(aux[key])
    for key in FRACTION_STATS:
        if key in aux:
            out[key] = jnp.mean(aux[key])
    return out


@dataclasses.dataclass
class Steps:
    """The jitted functions of one model graph."""

    train_step: Callable
    eval_step: Callable


def make_steps(graphdef, tx: optax.GradientTransformation, eval_graphdefs: dict[str, Any]) -> Steps:
    def split_batch(batch):
        batch = batch.astype(jnp.int32)  # [B, S+1]
        return batch[:, :-1], batch[:, 1:]  # inputs, targets [B, S]

    def train_step(params, rest, opt_state, batch):
        inputs, targets = split_batch(batch)

        def loss_fn(params, rest):
            model = nnx.merge(graphdef, params, rest, copy=True)  # fresh Variables in this trace
            logits, aux = model(inputs)  # [B, S, V]
            ce = cross_entropy(logits, targets)
            new_rest = nnx.state(model, nnx.Not(nnx.Param))
            return ce + aux["loss"], (ce, aux, new_rest)

        (loss, (ce, aux, new_rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "ce": ce, "aux_loss": aux["loss"], "grad_norm": optax.tree.norm(grads)}
        metrics.update(routing_summary(aux))
        return params, new_rest, opt_state, metrics

    def eval_step(params, rest, batch):
        inputs, targets = split_batch(batch)
        out = {}
        for name, (gd, own_rest) in eval_graphdefs.items():
            logits, _ = nnx.merge(gd, params, rest if own_rest is None else own_rest)(inputs)
            out[name] = cross_entropy(logits, targets)
        return out

    return Steps(
        train_step=jax.jit(train_step, donate_argnums=(0, 1, 2)),
        eval_step=jax.jit(eval_step),
    )


def warn(message: str) -> None:
    """A warning the user must see (stderr, not a log level that may be filtered)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def write_text_atomic(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file and a rename: a kill leaves the old
    file or the new one, never half of either."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def parse_metrics(text: str, path: str | pathlib.Path = "metrics.jsonl") -> list[dict]:
    """Records of a metrics file; a line that is not a JSON object (a kill mid-write tears
    the last line) is dropped with a warning naming its line number."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError:
            warn(f"{path}: dropped line {number}, which is not a complete JSON record "
                 f"(a run killed mid-write?): {line[:80]!r}")
            continue
        records.append(record)
    return records


class MetricsLog:
    """Appends one JSON object per line; on resume drops records past the resumed step (and
    a torn line, with a warning). The file is only ever rewritten atomically."""

    def __init__(self, path: pathlib.Path, resume_step: int | None, enabled: bool = True):
        """`enabled=False` (processes other than 0 in a multi-process run) writes nothing."""
        self.path = path
        self.enabled = enabled
        if not enabled:
            return
        if resume_step is None:
            write_text_atomic(path, "")
        else:
            records = parse_metrics(path.read_text(), path) if path.exists() else []
            kept = [r for r in records if r.get("step", 0) <= resume_step]
            write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    return parse_metrics(pathlib.Path(path).read_text(), path)


class RunDirError(FileExistsError):
    """A new run was pointed at a directory that already holds files."""


# What a run writes into its directory (all that `overwrite=True` deletes).
RUN_OUTPUTS = ("checkpoints", "checkpoints_skipped", "metrics.jsonl", "config.json", "summary.json", "loss.png")


def prepare_new_run_dir(out_dir: pathlib.Path, overwrite: bool) -> None:
    """Refuses a non-empty `out_dir` unless `overwrite`, which deletes the previous run's
    outputs (`RUN_OUTPUTS`, nothing else) before the new run starts."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"the output directory {out_dir} is a file.")
    existing = sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []
    if existing and not overwrite:
        shown = ", ".join(existing[:6]) + (", ..." if len(existing) > 6 else "")
        raise RunDirError(
            f"the output directory {out_dir} is not empty ({shown}). Pass --resume to continue "
            f"the run in it, --overwrite to delete it and start again, or another --out."
        )
    if existing:
        warn(f"--overwrite: deleting the previous run's outputs in {out_dir}.")
        for name in RUN_OUTPUTS:
            path = out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def first_nonfinite_step(host_metrics: list[dict], last_step: int) -> tuple[int, str, float, dict] | None:
    """(step, key, value, metrics) of the first step whose loss or grad_norm is not finite.

    `host_metrics` are the per-step metrics of steps `last_step - len + 1 .. last_step`.
    """
    first = last_step - len(host_metrics) + 1
    for offset, metrics in enumerate(host_metrics):
        for key in ("loss", "grad_norm"):
            value = float(metrics[key])
            if not math.isfinite(value):
                return first + offset, key, value, metrics
    return None


def divergence_error(step: int, key: str, value: float, metrics: dict, log_path) -> FloatingPointError:
    detail = ""
    bad_tokens = float(metrics.get("nonfinite_tokens", 0))
    if bad_tokens:
        detail = f" ({bad_tokens:.0f} tokens had non-finite router logits, summed over layers)"
    elif key == "grad_norm":
        detail = f" (the loss was {float(metrics['loss'])})"
    return FloatingPointError(
        f"{key} became {value} at step {step}{detail}; no checkpoint of this or a later step was "
        f"written. Metrics so far: {log_path}."
    )


# Config fields that may differ between a checkpoint and the run resuming it.
RESUMABLE_CHANGES = {"steps", "warmup_steps", "out", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "name"}
# Config fields since removed, with the value that trains as the code does now: a checkpoint
# that saved them resumes only at that value. comm_sms (SMs the chunked overlap's kernels
# left to the collectives) was removed in session 36: no effect measured on H200s.
RETIRED_FIELDS = {"comm_sms": 0}


def config_changes(saved: dict, cfg: Config) -> set[str]:
    """Fields of a checkpoint's saved config that differ from `cfg` and forbid resuming it:
    any but RESUMABLE_CHANGES, and retired fields saved at another value than their
    RETIRED_FIELDS one."""
    now = cfg.to_dict()
    return {
        k for k, v in saved.items()
        if k not in RESUMABLE_CHANGES and (RETIRED_FIELDS[k] != v if k in RETIRED_FIELDS else now.get(k) != v)
    }


@dataclasses.dataclass
class RunResult:
    out_dir: pathlib.Path
    metrics_path: pathlib.Path
    checkpoint_path: pathlib.Path | None
    plot_path: pathlib.Path | None
    final_step: int
    final_val: dict[str, float]
    train_tokens_per_s: float
    summary: dict
    # Set when a resumed run had nothing left to do (nothing was written): says why.
    nothing_to_do: str | None = None


def train(
    cfg: Config,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    plot: bool = True,
    stop_at: int | None = None,
    data_split: tuple[np.ndarray, np.ndarray, dict] | None = None,
) -> RunResult:
    """Trains `cfg` (resuming from its output directory's latest checkpoint when `resume`).

    Args:
      resume: continue from the newest checkpoint in `cfg.out_dir` that restores cleanly;
        damaged newer ones are reported and moved to `<out>/checkpoints_skipped/`. A run
        already at `steps` changes nothing (`RunResult.nothing_to_do` says so).
      overwrite: a new run (not `resume`) into a directory that holds files deletes the
        previous run's outputs; without it such a directory raises `RunDirError`.
      stop_at: stop after this step (checkpointing there) without changing the schedule;
        used to test resume. Default: `cfg.steps`.
      data_split: (train bytes, val bytes, info) to reuse across runs; read from the stdlib if None.
    """
    validate(cfg)
    try:
        resolve_backend(cfg.backend)  # e.g. "mosaic" without a Hopper GPU: fail before anything else
    except ValueError as error:
        raise ConfigError(f"backend: {error}") from None
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other (--resume keeps the run, --overwrite deletes it).")
    mesh = distributed.make_mesh(cfg)  # None: one device
    primary = distributed.is_primary()  # only process 0 writes metrics, plots and summaries
    out_dir = pathlib.Path(cfg.out_dir)
    if resume:
        if not (out_dir / "checkpoints").is_dir():
            raise FileNotFoundError(f"no checkpoint in {out_dir / 'checkpoints'}")
    elif primary:  # process 0 owns the output directory
        prepare_new_run_dir(out_dir, overwrite)
    ckpt_dir = out_dir / "checkpoints"
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("train: output directory ready")
    stop_at = cfg.steps if stop_at is None else min(stop_at, cfg.steps)

    train_bytes, val_bytes, data_info = data_split or data.load_split(cfg.val_percent)
    if cfg.max_train_bytes:
        train_bytes = train_bytes[: cfg.max_train_bytes]
    loader = data.Batches(train_bytes, cfg.batch_size, cfg.seq_len, cfg.seed)
    val_batches = data.validation_batches(val_bytes, cfg.batch_size, cfg.seq_len, cfg.eval_batches)

    model = build_model(cfg, mesh=mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    eval_graphdefs = {"val_loss": (graphdef, None)}  # name -> (graph, own rest or None)
    if cfg.routing == "token_rounding":
        # The same weights evaluated with plain top-K routing (no expert-choice top-up).
        tc_model = nnx.eval_shape(lambda: build_model(dataclasses.replace(cfg, routing="topk"), mesh=mesh))
        tc_graphdef, tc_params, tc_rest = nnx.split(tc_model, nnx.Param, ...)
        if jax.tree.structure(tc_params) == jax.tree.structure(params) and not jax.tree.leaves(tc_rest):
            eval_graphdefs["val_loss_topk"] = (tc_graphdef, tc_rest)
    tx = build_optimizer(cfg)
    put_batch = lambda batch: batch  # host numpy batches go straight to the one device
    example = np.zeros((cfg.batch_size, cfg.seq_len + 1), np.uint8)  # only shape and dtype matter
    if mesh is not None:
        # Global arrays: expert weights split over the expert axis, the rest replicated,
        # batches split over every device. Every process holds the same host values.
        params = distributed.to_global(params, distributed.param_shardings(params, mesh))
        rest = distributed.to_global(rest, distributed.replicated(rest, mesh))
        sharding = distributed.batch_sharding(mesh)
        put_batch = lambda batch: jax.device_put(batch, sharding)
        example = jax.ShapeDtypeStruct(example.shape, example.dtype, sharding=sharding)
        val_batches = [put_batch(b) for b in val_batches]
    opt_state = jax.jit(tx.init)(params)  # optimizer state sharded like the parameters
    steps = make_steps(graphdef, tx, eval_graphdefs)

    mgr = checkpoint.manager(ckpt_dir, cfg.keep_checkpoints) if (cfg.checkpoint_every or resume) else None
    start_step = 0
    skipped: list[tuple[int, str]] = []
    if resume:

        def check_config(meta: dict) -> None:
            changed = config_changes(meta["config"], cfg)
            if changed:
                raise ValueError(
                    f"cannot resume: config fields {sorted(changed)} differ from the checkpoint's "
                    f"({', '.join(f'{k}={meta['config'][k]!r}' for k in sorted(changed))})."
                )

        template = {"params": params, "rest": rest, "opt_state": opt_state}
        start_step, state, meta, skipped = checkpoint.restore_newest_valid(mgr, template, check_config)
        for step_skipped, reason in skipped:
            warn(f"checkpoint {ckpt_dir / str(step_skipped)} does not restore, skipped ({reason}).")
        if start_step >= stop_at:
            # Nothing to train: leave every file as it is (metrics, summary, plot, checkpoints).
            why = (f"the run in {out_dir} already finished: its checkpoint is at step {start_step} "
                   f"and steps={cfg.steps}" if start_step >= cfg.steps else
                   f"the checkpoint in {out_dir} is at step {start_step}, past stop_at={stop_at}")
            summary_path = out_dir / "summary.json"
            summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
            return RunResult(
                out_dir=out_dir, metrics_path=out_dir / "metrics.jsonl", checkpoint_path=ckpt_dir / str(start_step),
                plot_path=None, final_step=start_step, final_val=summary.get("final_val", {}),
                train_tokens_per_s=summary.get("train_tokens_per_s", float("nan")), summary=summary,
                nothing_to_do=why,
            )
        if skipped:
            moved = checkpoint.set_aside(mgr, [s for s, _ in skipped], out_dir / "checkpoints_skipped")
            warn(f"resuming from step {start_step}; the skipped checkpoints were moved to "
                 f"{', '.join(map(str, moved))}.")
        params, rest, opt_state = state["params"], state["rest"], state["opt_state"]
        loader.restore(meta["data"])
    log = MetricsLog(out_dir / "metrics.jsonl", start_step if resume else None, enabled=primary)
    if primary:
        write_text_atomic(out_dir / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")

    def evaluate(step: int) -> dict[str, float]:
        sums: dict[str, float] = {}
        for batch in val_batches:
            for k, v in steps.eval_step(params, rest, batch).items():
                sums[k] = sums.get(k, 0.0) + float(v)
        result = {k: v / len(val_batches) for k, v in sums.items()}
        log.write({"step": step, "split": "val", **result})
        return result

    def save(step: int) -> pathlib.Path:
        state = {"params": params, "rest": rest, "opt_state": opt_state}
        meta = {"step": step, "data": loader.state(), "config": cfg.to_dict()}
        checkpoint.save(mgr, step, state, meta)
        return ckpt_dir / str(step)

    # Compile ahead of time so the first interval's tokens/s is not compile time.
    t0 = time.perf_counter()
    compiled = steps.train_step.lower(params, rest, opt_state, example).compile()
    compile_s = time.perf_counter() - t0

    header = {
        "step": start_step, "split": "info", "config": cfg.to_dict(), "data": data_info,
        "num_params": num_params, "backend": jax.default_backend(),
        "devices": str(jax.devices() if mesh is None else mesh.devices.tolist()),
        "processes": jax.process_count(),
        "compile_s": compile_s, "resumed": bool(resume),
        "skipped_checkpoints": [{"step": s, "reason": r} for s, r in skipped],
    }
    log.write(header)

    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=start_step, disable=not (progress and primary), dynamic_ncols=True,
               mininterval=1.0, desc=cfg.name, unit="step")
    last_val: dict[str, float] = {}
    if start_step == 0:
        last_val = evaluate(0)
    schedule = lr_schedule(cfg)
    interval_metrics: list[dict] = []
    interval_start = time.perf_counter()
    paused = 0.0  # seconds of validation and checkpointing inside the current interval
    record: dict = {}
    train_time = 0.0
    train_tokens = 0
    last_ckpt = None
    step = start_step
    checked_steps = 0  # leading entries of interval_metrics already checked finite

    def check_finite_so_far() -> None:
        """Raises on the first non-finite loss / grad norm of the open interval. Runs before
        every log record, evaluation and checkpoint, so NaN parameters are never saved."""
        nonlocal checked_steps
        pending = jax.device_get(interval_metrics[checked_steps:])
        bad = first_nonfinite_step(pending, step)
        if bad is not None:
            bar.close()
            raise divergence_error(*bad, log.path)
        checked_steps = len(interval_metrics)

    while step < stop_at:
        batch = put_batch(loader.next())
        params, rest, opt_state, metrics = compiled(params, rest, opt_state, batch)
        step += 1
        interval_metrics.append(metrics)
        bar.update(1)
        if step % cfg.log_every == 0 or step == stop_at:
            check_finite_so_far()
            host = jax.device_get(interval_metrics)  # blocks: the interval's work is done
            elapsed = time.perf_counter() - interval_start - paused
            tokens = len(host) * cfg.tokens_per_step
            train_time += elapsed
            train_tokens += tokens
            record = {"step": step, "split": "train", "lr": float(schedule(step - 1)),
                      "tokens_per_s": tokens / elapsed}
            for key in host[-1]:
                record[key] = float(np.mean([m[key] for m in host]))
            log.write(record)
            bar.set_postfix(loss=f"{record['ce']:.3f}", val=f"{last_val.get('val_loss', float('nan')):.3f}",
                            tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            interval_metrics, checked_steps = [], 0
        t_pause = time.perf_counter()  # validation and checkpoint time is not train time
        evaluating = step % cfg.eval_every == 0 or step == cfg.steps
        saving = cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == stop_at)
        if (evaluating or saving) and interval_metrics:
            check_finite_so_far()
        if evaluating:
            last_val = evaluate(step)
            bar.set_postfix(loss=f"{record.get('ce', float('nan')):.3f}", val=f"{last_val['val_loss']:.3f}",
                            tok_s=f"{record.get('tokens_per_s', 0):.0f}", refresh=False)
        if saving:
            last_ckpt = save(step)
        if not interval_metrics:  # an interval just closed: the next one starts now
            interval_start, paused = time.perf_counter(), 0.0
        else:
            paused += time.perf_counter() - t_pause
    bar.close()
    if last_ckpt is None and mgr is not None and mgr.latest_step() is not None:
        last_ckpt = ckpt_dir / str(mgr.latest_step())

    tokens_per_s = train_tokens / train_time if train_time else float("nan")
    summary = {
        "config": cfg.name, "routing": cfg.routing, "final_step": step, "num_params": num_params,
        "final_val": last_val, "train_tokens_per_s": tokens_per_s, "train_time_s": train_time,
        "compile_s": compile_s, "backend": jax.default_backend(),
    }
    plot_path = None
    if primary:
        write_text_atomic(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    if plot and primary:
        from train.plots import plot_run

        plot_path = plot_run(log.path, out_dir / "loss.png", title=f"{cfg.name} ({cfg.routing})")
    return RunResult(
        out_dir=out_dir, metrics_path=log.path, checkpoint_path=last_ckpt, plot_path=plot_path,
        final_step=step, final_val=last_val, train_tokens_per_s=tokens_per_s, summary=summary,
    )
