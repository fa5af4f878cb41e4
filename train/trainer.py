"""The training loop: AdamW with warmup + cosine, jitted steps, validation, JSONL metrics,
orbax checkpoints with exact resume, and a loss-curve plot.

The model is split once into a static graph and two pytrees, `params` (nnx.Param) and
`rest` (any other state, such as RNG streams); the train step is a pure `jax.jit` function
of `(params, rest, opt_state, batch)`. Everything a run needs to continue bit-exactly lives
in the checkpoint: params, rest, optimizer state, step and the data loader's position.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train import checkpoint, data, distributed
from train.configs import Config, validate
from train.model import MoETransformer

# Routing statistics logged per step (summed over layers for row counts, averaged otherwise).
ROW_STATS = ("dropped_rows", "added_rows", "padding_rows", "tc_padding_rows")
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


class MetricsLog:
    """Appends one JSON object per line; on resume drops records past the resumed step."""

    def __init__(self, path: pathlib.Path, resume_step: int | None, enabled: bool = True):
        """`enabled=False` (processes other than 0 in a multi-process run) writes nothing."""
        self.path = path
        self.enabled = enabled
        if not enabled:
            return
        if resume_step is None:
            path.write_text("")
        else:
            kept = []
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
            path.write_text("".join(k + "\n" for k in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | pathlib.Path) -> list[dict]:
    return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines() if l.strip()]


# Config fields that may differ between a checkpoint and the run resuming it.
RESUMABLE_CHANGES = {"steps", "warmup_steps", "out", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "name"}


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


def train(
    cfg: Config,
    *,
    resume: bool = False,
    progress: bool = True,
    plot: bool = True,
    stop_at: int | None = None,
    data_split: tuple[np.ndarray, np.ndarray, dict] | None = None,
) -> RunResult:
    """Trains `cfg` (resuming from its output directory's latest checkpoint when `resume`).

    Args:
      stop_at: stop after this step (checkpointing there) without changing the schedule;
        used to test resume. Default: `cfg.steps`.
      data_split: (train bytes, val bytes, info) to reuse across runs; read from the stdlib if None.
    """
    validate(cfg)
    mesh = distributed.make_mesh(cfg)  # None: one device
    primary = distributed.is_primary()  # only process 0 writes metrics, plots and summaries
    out_dir = pathlib.Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out_dir / "checkpoints"
    if not resume and ckpt_dir.exists() and primary:
        shutil.rmtree(ckpt_dir)  # a fresh run replaces the previous one in this directory
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
    if resume:
        start_step, meta = checkpoint.read_meta(mgr)
        changed = {
            k for k, v in meta["config"].items() if k not in RESUMABLE_CHANGES and cfg.to_dict().get(k) != v
        }
        if changed:
            raise ValueError(
                f"cannot resume: config fields {sorted(changed)} differ from the checkpoint's "
                f"({', '.join(f'{k}={meta['config'][k]!r}' for k in sorted(changed))})."
            )
        template = {"params": params, "rest": rest, "opt_state": opt_state}
        _, state, meta = checkpoint.restore(mgr, template, start_step)
        params, rest, opt_state = state["params"], state["rest"], state["opt_state"]
        loader.restore(meta["data"])
    log = MetricsLog(out_dir / "metrics.jsonl", start_step if resume else None, enabled=primary)
    if primary:
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

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
    while step < stop_at:
        batch = put_batch(loader.next())
        params, rest, opt_state, metrics = compiled(params, rest, opt_state, batch)
        step += 1
        interval_metrics.append(metrics)
        bar.update(1)
        if step % cfg.log_every == 0 or step == stop_at:
            host = jax.device_get(interval_metrics)  # blocks: the interval's work is done
            elapsed = time.perf_counter() - interval_start - paused
            tokens = len(host) * cfg.tokens_per_step
            train_time += elapsed
            train_tokens += tokens
            record = {"step": step, "split": "train", "lr": float(schedule(step - 1)),
                      "tokens_per_s": tokens / elapsed}
            for key in host[-1]:
                record[key] = float(np.mean([m[key] for m in host]))
            if not math.isfinite(record["loss"]):
                bar.close()
                raise FloatingPointError(f"loss became {record['loss']} at step {step}; see {log.path}.")
            log.write(record)
            bar.set_postfix(loss=f"{record['ce']:.3f}", val=f"{last_val.get('val_loss', float('nan')):.3f}",
                            tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            interval_metrics = []
        t_pause = time.perf_counter()  # validation and checkpoint time is not train time
        if step % cfg.eval_every == 0 or step == cfg.steps:
            last_val = evaluate(step)
            bar.set_postfix(loss=f"{record.get('ce', float('nan')):.3f}", val=f"{last_val['val_loss']:.3f}",
                            tok_s=f"{record.get('tokens_per_s', 0):.0f}", refresh=False)
        if cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == stop_at):
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
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if plot and primary:
        from train.plots import plot_run

        plot_path = plot_run(log.path, out_dir / "loss.png", title=f"{cfg.name} ({cfg.routing})")
    return RunResult(
        out_dir=out_dir, metrics_path=log.path, checkpoint_path=last_ckpt, plot_path=plot_path,
        final_step=step, final_val=last_val, train_tokens_per_s=tokens_per_s, summary=summary,
    )
