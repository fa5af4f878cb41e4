"""Whole MoE layer training step on the GPU: router GEMM, routing, forward and backward.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/step.py --out $OUT [--shapes 7b,30b]
    ... --shapes gpt-oss-20b --gpt-oss --xla-check gpt-oss-20b   # expert biases, clamped SwiGLU

One jitted `value_and_grad` of `sum(moe_layer(x) * cot)` with respect to x, the router and
both expert weights, where the layer computes `logits = x @ router` (a bf16 linear layer
with fp32 accumulation by default, as SonicMoE's layer does; `--router-dtype float32` for
fp32 products), routes (top-K
or token rounding), and runs `pm.moe_ffn(backend="mosaic")`. That is the step SonicMoE's
"whole layer forward+backward" figure measures (3.30 ms at 7B on an H100).

For each shape and variant (routing x row loader) it reports GPU kernel time (CUPTI: the sum
of every kernel one step launches), wall time of one jitted step (median), which also
counts launch gaps and host work, and the pipelined time per step (10 steps dispatched
back to back, one block at the end: a training loop's view, without one call's dispatch
latency), plus two same-run bounds: the dense bound (a dense XLA layer with the MoE
FLOPs as balanced batched matmuls, forward and backward, its SwiGLU and f32 cotangent
included; `bound/step`) and its six GEMMs alone (`GEMMs/step`: the batched-matmul bound as
SonicMoE states it, `layer.gemm_bound_fn`), and breaks the step down kernel by kernel. Before
timing, every variant's loss and gradients are compared on the device with the first
variant of the same routing (and with the `xla` backend for the shapes in --xla-check).
Writes step.json, step_log.txt and step.md into --out. `--gpt-oss`: the layer also has
expert biases on both projections (differentiated too) and gpt-oss's clamped SwiGLU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import glob
import json
import os
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

import pallas_moe as pm
from benchmarks.gpu_clocks import ClockLog
from benchmarks.logs import open_log
from benchmarks.forward import (
    SHAPES, cooperative_up_cfg, pingpong_up, gpu_time_ms, interleaved_times_ms, pipelined_ms,
    wall_time_ms,
)
from benchmarks.layer import dense_bound_fns, gemm_bound_fn
from pallas_moe.kernels import KernelConfig
from pallas_moe.kernels.moe_backward import dh_split_gemm_config
from pallas_moe.kernels.moe_forward import (PINGPONG_DOWN, default_device_kind, default_num_sms,
                                            pingpong_down_config, split_m_up_config)
from pallas_moe.nn.functional import router_logits

ITERS = 5


def kernel_key(kernel_name: str) -> str:
    """A kernel's name without its argument list, at most 60 characters."""
    return kernel_name.split("(")[0][:60]


def kernel_breakdown(f, *args):
    """[(kernel name, ms)] of one step, summed per name, largest first."""
    jax.block_until_ready(f(*args))
    _, timings = profiler.measure(f, aggregate=False)(*args)
    per = collections.Counter()
    count = collections.Counter()
    for name, ms in timings:
        key = kernel_key(name)
        per[key] += ms
        count[key] += 1
    return [(k, per[k], count[k]) for k, _ in per.most_common()]


def traced_gpu_events_by_device(f, *args, steps: int) -> dict[str, list]:
    """{device plane name ("/device:GPU:0", ...): [(start ns, end ns, name)]} of every kernel
    and copy on each GPU's streams while `steps` calls of f run back to back under
    `jax.profiler.trace`, each list sorted by start."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            outs = [f(*args) for _ in range(steps)]
            jax.block_until_ready(outs)
        del outs
        (pb,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(pb)
        events = {}
        for plane in data.planes:
            if plane.name.startswith("/device:GPU"):
                for line in plane.lines:
                    if line.name.startswith("Stream"):
                        events.setdefault(plane.name, []).extend(
                            (e.start_ns, e.end_ns, e.name) for e in line.events)
    return {device: sorted(evs) for device, evs in sorted(events.items())}


def traced_gpu_events(f, *args, steps: int):
    """[(start ns, end ns, name)] of every kernel and copy on the GPU's streams while `steps`
    calls of f run back to back under `jax.profiler.trace`, sorted by start (every GPU's
    events in one list: meant for one-GPU programs)."""
    by_device = traced_gpu_events_by_device(f, *args, steps=steps)
    return sorted(e for evs in by_device.values() for e in evs)


def concurrent_kernels(events):
    """{(earlier kernel, later kernel): ns} of time two GPU events ran at once, from
    `traced_gpu_events`' sorted (start ns, end ns, name) list. One stream runs its kernels
    one after another, so any overlap is two streams running side by side (an XLA kernel
    beside a Pallas kernel that assumes the whole GPU, say)."""
    overlaps = collections.Counter()
    running = []  # (end, name) of the events started so far that may still run
    for start, end, name in events:
        running = [(e, n) for e, n in running if e > start]
        for other_end, other in running:
            overlaps[(kernel_key(other), kernel_key(name))] += min(end, other_end) - start
        running.append((end, name))
    return overlaps


def idle_between_kernels(f, *args, steps: int = 5, top: int = 10):
    """Where a training loop's GPU waits between kernels: `steps` calls dispatched back to
    back under `jax.profiler.trace`, every kernel and copy of the device's streams, their
    union (busy), the span from the first start to the last end, and the idle time in
    between, each per step; plus the `top` idle gaps summed by (kernel before, kernel after),
    in microseconds per step, and the `top` pairs of kernels that ran at the same time on
    different streams (`concurrent_kernels`), in microseconds of overlap per step. A gap is
    time no stream runs anything: launch latency, host work the GPU waits for, or a kernel's
    ramp that the previous one's tail does not cover.
    (Whether XLA's command buffers capture the kernels does not show in the compiled HLO
    text; compare runs under `XLA_FLAGS=--xla_gpu_enable_command_buffer=...` instead.)"""
    jax.block_until_ready(f(*args))
    events = traced_gpu_events(f, *args, steps=steps)
    if not events:
        return dict(error="no GPU stream events in the trace")
    gaps = collections.Counter()
    busy = 0.0
    start, end, prev = events[0]
    busy_start = start
    for s, e, name in events[1:]:
        if s > end:  # nothing runs on any stream between `end` and `s`
            gaps[(kernel_key(prev), kernel_key(name))] += s - end
            busy += end - busy_start
            busy_start = s
        if e > end:
            end, prev = e, name
    busy += end - busy_start
    span = end - start
    per_step_ms = lambda ns: ns / steps / 1e6  # noqa: E731
    return dict(
        span_ms=per_step_ms(span), busy_ms=per_step_ms(busy), idle_ms=per_step_ms(span - busy),
        events_per_step=len(events) / steps,
        top_gaps_us=[(a, b, 1e3 * per_step_ms(ns)) for (a, b), ns in gaps.most_common(top)],
        concurrent_us=[(a, b, 1e3 * per_step_ms(ns))
                       for (a, b), ns in concurrent_kernels(events).most_common(top)])


def make_step(shape, routing, backend, config, skew: float = 0.0, gpt_oss: bool = False,
              harness: str = "vjp", router_dtype: str = "bfloat16"):
    """The jitted step; `harness` is how the backward is driven: "vjp" (forward, then the
    backward of a given bf16 output cotangent `cot`, as SonicMoE times its layer; returns
    (out, grads)) or "loss" (`value_and_grad` of `sum(out * cot)` with an f32 `cot`, which
    adds a [T, d] convert-multiply-reduce and its backward to the step). `skew` is added to the router logits of the first quarter of the
    experts (skewed routing: those experts get more rows, the others fewer). `gpt_oss`: the
    step takes two more inputs, the expert biases (`step_bias_inputs`), differentiates them
    too, and uses the clamped SwiGLU. `router_dtype` is the router GEMM's precision
    (`pm.nn.functional.router_logits`): "float32" (fp32 inputs and products) or "bfloat16"
    (a bf16 linear layer with fp32 accumulation, as SonicMoE's benchmark layer computes its
    logits: `F.linear(x, router_w)` on bf16 tensors, softmax in fp32)."""
    num_tokens, d, n, num_experts, k = shape
    skew_bias = jnp.where(jnp.arange(num_experts) < max(num_experts // 4, 1), skew, 0.0)
    options = dict(activation=pm.ops.SwiGLU.clamped()) if gpt_oss else {}

    def layer(x, router, w1, w2, b1=None, b2=None):
        logits = router_logits(x, router, dtype=router_dtype)  # f32[T, E]
        if skew:
            logits = logits + skew_bias
        if routing == "topk":
            plan = pm.routing.topk_plan(logits, k)
        else:
            plan = pm.routing.token_rounding_plan(logits, k, tile=128, rounding="nearest")
        return pm.moe_ffn(x, plan, w1, w2, b_gate_up=b1, b_down=b2, backend=backend,
                          config=config, **options)

    if harness == "vjp":
        def step(x, router, w1, w2, cot, *biases):
            out, pullback = jax.vjp(layer, x, router, w1, w2, *biases)
            return out, pullback(cot.astype(out.dtype))

        return jax.jit(step)
    if harness != "loss":
        raise ValueError(f'harness must be "vjp" or "loss", got {harness!r}.')

    def loss(x, router, w1, w2, cot, b1=None, b2=None):
        return jnp.sum(layer(x, router, w1, w2, b1, b2).astype(jnp.float32) * cot)

    argnums = (0, 1, 2, 3, 5, 6) if gpt_oss else (0, 1, 2, 3)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums))


def step_bias_inputs(shape, seed):
    """Fresh random expert biases (b_gate_up [E, 2n], b_down [E, d]) for `--gpt-oss`."""
    _, d, n, num_experts, _ = shape
    ks = jax.random.split(jax.random.key(seed + 1), 2)
    return (jax.random.normal(ks[0], (num_experts, 2 * n), jnp.bfloat16),
            jax.random.normal(ks[1], (num_experts, d), jnp.bfloat16))


def step_inputs(shape, seed):
    """Fresh random (x, router, w_gate_up, w_down, cotangent) of one layer step."""
    num_tokens, d, n, num_experts, _ = shape
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (num_tokens, d), jnp.bfloat16)
    router = jax.random.normal(ks[1], (d, num_experts), jnp.float32) * d**-0.5
    w1 = (jax.random.normal(ks[2], (num_experts, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (num_experts, n, d)) * n**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(ks[4], (num_tokens, d), jnp.float32)
    return x, router, w1, w2, cot


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _replace(config: KernelConfig, kernel: str, **fields) -> KernelConfig:
    """`config` with the fields of one kernel's config replaced (kernel: the forward's "up" or
    "down", or a field of `BackwardConfig`: "dh", "dw_down", "dw_gate_up", "dx")."""
    part = "forward" if kernel in ("up", "down") else "backward"
    sub = getattr(config, part)
    sub = dataclasses.replace(sub, **{kernel: dataclasses.replace(getattr(sub, kernel), **fields)})
    return dataclasses.replace(config, **{part: sub})


def _replace_up(config: KernelConfig, up) -> KernelConfig:
    """`config` with another up-proj config, keeping the variant's row loader and exp."""
    up = dataclasses.replace(up, gather=config.forward.up.gather,
                             approx_math=config.forward.up.approx_math)
    return dataclasses.replace(config, forward=dataclasses.replace(config.forward, up=up))


def _whole_tile(config: KernelConfig, kernel: str) -> KernelConfig:
    """`config` with the ping-pong `kernel` ("down" or "dx") staging its whole output tile
    beside `PINGPONG_DOWN`'s stages (unchanged if that kernel is not the ping-pong)."""
    sub = getattr(config.forward if kernel == "down" else config.backward, kernel)
    if not sub.pingpong:
        return config
    return _replace(config, kernel, out_slabs=0, num_stages=PINGPONG_DOWN.num_stages)


def _split_dh(config: KernelConfig, da_dtype: str) -> KernelConfig:
    """`config` with dH split in two and dA' in `da_dtype` between its kernels: the default
    split's GEMM where `for_shape` splits dH, else the same split forced
    (`dh_split_gemm_config`: the up-proj's 128 x 256 items, 4 stages)."""
    bwd = config.backward
    gemm = bwd.dh_gemm or dh_split_gemm_config(bwd.dh.persistent_ctas)
    return dataclasses.replace(config, backward=dataclasses.replace(
        bwd, dh_gemm=gemm, dh_da_dtype=da_dtype))


# Variant flags (`--variants routing/gather/.../flag`): an A/B change of the default config,
# a function of (config, n).
CONFIG_FLAGS = {
    # (Session 42 removed "untiled-dh", the persistent dH's epilogue before session 21, and
    # "persistent-dh", for d >= 4096 where dH ran one CTA per tile before session 21, with
    # those dH variants: one kernel per op.)
    # The up-proj's gathered stages published by the producer's lagged wait (the H100's
    # default; session 22 made mbarriers the H200's for the ping-pong kernel).
    "lagged-up": lambda c, n: _replace(c, "up", gather_completion="wait_group"),
    # The H200's choice on any card (e.g. to measure it again on an H100).
    "mbarrier-up": lambda c, n: _replace(c, "up", gather_completion="mbarrier"),
    # The persistent split-M up-proj (session 24: the H200's default for 1536 < d <= 4096)
    # at any width and on any card, e.g. to measure it on an H100 or at 7B.
    "split-m-up": lambda c, n: _replace_up(c, split_m_up_config(default_num_sms(), n)),
    # Split-M items on clusters of two CTAs sharing each weight tile (`cluster_m=2`,
    # session 49), from this width's split-M form; session 50 made them the default from
    # d = 2880 on, and "no-cluster-up" runs those widths' items on single CTAs.
    "cluster-up": lambda c, n: _replace_up(
        c, split_m_up_config(default_num_sms(), n, cluster_m=2)),
    "no-cluster-up": lambda c, n: _replace(c, "up", cluster_m=1),
    # The up-proj's consumers release each slot as soon as its own step's wgmmas are done
    # (`UpProjConfig.wgmma_lag=0`, session 51).
    "lag0-up": lambda c, n: _replace(c, "up", wgmma_lag=0),
    # The same release in the other grouped GEMMs that take it (down-proj, dX~; dH's and
    # the weight gradients' was removed in session 64: level on the H100).
    "lag0-rest": lambda c, n: functools.reduce(
        lambda cfg, k: _replace(cfg, k, wgmma_lag=0), ("down", "dx"), c),
    # The up-proj and down-proj at lag 1, the forward's default before session 54 (which
    # made lag 0 the H100's for the 192-row up-proj and the 192-column 3-stage down-proj).
    "lag1-forward": lambda c, n: _replace(_replace(c, "up", wgmma_lag=1), "down", wgmma_lag=1),
    # dX~ at lag 1, its default before session 64 (which made lag 0 the H100's for its
    # 192-column 3-stage items, gpt-oss's widths).
    "lag1-dx": lambda c, n: _replace(c, "dx", wgmma_lag=1),
    # (Session 64 removed "cluster-gemm", the down-proj and dX~ on clusters of two CTAs
    # sharing each weight tile: 0.893x / 0.981x the split-M down-proj on the H100.)
    # The fused dH kernel where the default splits dH in two (d >= 4096 since session 60,
    # d >= 2048 since session 63).
    "fused-dh": lambda c, n: dataclasses.replace(c, backward=dataclasses.replace(
        c.backward, dh_gemm=None, dh_da_dtype="float32")),
    # dH split in two with dA' in bf16 between its kernels (`BackwardConfig.dh_da_dtype`,
    # the default where it splits since session 63): below d = 2048 the split forced.
    "split-dh-bf16": lambda c, n: _split_dh(c, "bfloat16"),
    # The same split with dA' in f32 (dH and A' the fused kernel's bits): the default at
    # d >= 4096 from session 60 to 62.
    "split-dh-f32": lambda c, n: _split_dh(c, "float32"),
    # Both aggregations (the forward's and dX's) as before session 66: one row at a time
    # (`AggregateConfig.rows_in_flight=1`) and the configured tokens per CTA at every size
    # (`resident_ctas=0`); at training sizes only the first differs from the default.
    "agg-1": lambda c, n: dataclasses.replace(
        c, forward=dataclasses.replace(c.forward, aggregate=dataclasses.replace(
            c.forward.aggregate, rows_in_flight=1, resident_ctas=0)),
        backward=dataclasses.replace(c.backward, aggregate=dataclasses.replace(
            c.backward.aggregate, rows_in_flight=1, resident_ctas=0))),
    # The weight gradients' gathered chunks 128 wide with 4 stages, the default before
    # session 64 made them 192 wide with 3 stages where 192 divides d (7B).
    "wg-128": lambda c, n: _replace(_replace(c, "dw_down", block_n=128, num_stages=4),
                                    "dw_gate_up", block_m=128, num_stages=4),
    # The down-proj as the 128-row ping-pong where session 61 made split-M items 256 columns
    # wide the default (n >= 768: long K loops).
    "pingpong-down": lambda c, n: dataclasses.replace(c, forward=dataclasses.replace(
        c.forward, down=pingpong_down_config(c.forward.down.num_sms, default_device_kind()))),
    # (Session 64 removed "split-m-192-gemm", the down-proj and dX~ with split-M items of
    # 192 rows on three consumers: 1.013-1.019x at gpt-oss, inside the spread.)
    # (Session 63 removed "cluster-wg", both weight gradients on clusters of two CTAs
    # sharing each contiguous K-block: 0.98-1.02x on the H100 in session 51.)
    # Split-M items of 192 rows, three consumers sharing each weight tile (session 49).
    "split-m-192-up": lambda c, n: _replace_up(
        c, split_m_up_config(default_num_sms(), n, rows=192)),
    # dH with one consumer warpgroup: the default before session 48 where 192 but not 128
    # divides n (gpt-oss), which now runs three of 64 columns.
    "one-consumer-dh": lambda c, n: _replace(c, "dh", num_consumers=1),
    # The weight gradients' consumers before session 49 where three of 64 now tile the
    # split side (gpt-oss: dW2 one consumer, dW1 two).
    "fewer-consumer-wg": lambda c, n: _replace(
        _replace(c, "dw_down", num_consumers=1 if c.backward.dw_down.num_consumers == 3
                 else c.backward.dw_down.num_consumers),
        "dw_gate_up", num_consumers=2 if c.backward.dw_gate_up.num_consumers == 3
        else c.backward.dw_gate_up.num_consumers),
    # The ping-pong up-proj (64-row items) at any width, e.g. against the split-M kernel
    # that session 30 made the H200's default at d <= 1536 from n = 512 on.
    "pingpong-up": lambda c, n: _replace_up(
        c, dataclasses.replace(pingpong_up(), pingpong_ctas=default_num_sms())),
    # The cooperative up-proj (one CTA per tile), the default before session 24 at d > 1536.
    "cooperative-up": lambda c, n: _replace_up(c, cooperative_up_cfg(n)),
    # Both weight gradients as persistent CTAs (session 23), 3 stages (what fits beside
    # their own output tiles).
    "persistent-wg": lambda c, n: _replace(
        _replace(c, "dw_gate_up", persistent_ctas=default_num_sms(), num_stages=3,
                 output_chunks=0),
        "dw_down", persistent_ctas=default_num_sms(), num_stages=3, output_chunks=0),
    # Persistent with 4 stages beside one output buffer per consumer (session 24; the H200's
    # default since session 25, every card's since session 44).
    "persistent-wg4": lambda c, n: _replace(
        _replace(c, "dw_gate_up", persistent_ctas=default_num_sms(), output_chunks=1),
        "dw_down", persistent_ctas=default_num_sms(), output_chunks=1),
    # The ping-pong down-proj and dX~ with the whole output tile staged (5 stages): the
    # H100's, and the H200's before session 37 (one slab staged; dX~ with 6 stages).
    "whole-tile-down": lambda c, n: _whole_tile(_whole_tile(c, "down"), "dx"),
    # One CTA per weight-gradient item (the default before session 25 on an H200; still
    # the H100's).
    "one-cta-wg": lambda c, n: _replace(
        _replace(c, "dw_gate_up", persistent_ctas=0, output_chunks=0),
        "dw_down", persistent_ctas=0, output_chunks=0),
}


def _scan_bias_gradients(step):
    """`step` traced with the previous expert-bias gradients (a row-tile scan, until session
    50; `benchmarks/bias_grads.py`) in place of today's dense products: it is patched in
    while `step` runs, so its first call (the trace) takes it; later calls reuse that trace."""
    import importlib
    import unittest.mock

    from benchmarks.bias_grads import scan_bias_gradients

    # The module (`pallas_moe.kernels.moe_backward` as an attribute is its function).
    moe_backward_module = importlib.import_module("pallas_moe.kernels.moe_backward")

    def patched(*args):
        with unittest.mock.patch.object(moe_backward_module, "expert_bias_gradients",
                                        scan_bias_gradients):
            return step(*args)

    return patched


@contextlib.contextmanager
def rows_first_dh_items():
    """While active, dH kernels traced walk their work items in the order before session 59:
    row tiles fastest (`w % num_tiles, w // num_tiles`), each column block a pass over every
    row tile; today's `dh.item_coords` puts a row tile's column blocks side by side. The
    same items computed the same way: the same bits."""
    import importlib
    import unittest.mock

    dh_module = importlib.import_module("pallas_moe.kernels.dh")
    persistent = dh_module._dh_persistent
    num_tiles = [0]

    def recording(config, d, n, tiles, *args, **kwargs):  # the previous order needs the count
        num_tiles[0] = tiles
        return persistent(config, d, n, tiles, *args, **kwargs)

    def rows_first(w, grid_n):
        return w % num_tiles[0], w // num_tiles[0]

    with unittest.mock.patch.object(dh_module, "_dh_persistent", recording), \
            unittest.mock.patch.object(dh_module, "item_coords", rows_first):
        yield


def _rows_first_dh(step):
    """`step` traced with dH's previous item order (`rows_first_dh_items`); as
    `_scan_bias_gradients`, its first call (the trace) takes the patch."""

    def patched(*args):
        with rows_first_dh_items():
            return step(*args)

    return patched


# Code flags (`--variants .../flag`): the step traced with a previous code path, for paired
# timings against it; each wraps the step.
CODE_FLAGS = {
    # The expert-bias gradients as the row-tile scan before session 50 (`--gpt-oss`).
    "scan-bias": _scan_bias_gradients,
    # dH's work items row tiles fastest, the order before session 59.
    "rows-first-dh": _rows_first_dh,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="7b,30b")
    ap.add_argument("--variants", default="topk/cp_async,token_rounding/cp_async",
                    help="routing/gather[/harness][/flag...], harness as --harness; flags "
                         f"change the default config: {', '.join(CONFIG_FLAGS)} (CONFIG_FLAGS), "
                         f"or trace a previous code path: {', '.join(CODE_FLAGS)} (CODE_FLAGS)")
    ap.add_argument("--harness", default="vjp", choices=("vjp", "loss"),
                    help="vjp: forward + backward of a bf16 output cotangent (SonicMoE's "
                         "timing); loss: value_and_grad of sum(out * f32 cotangent)")
    ap.add_argument("--xla-check", default="", help="shapes also checked against backend=xla")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="added to the router logits of a quarter of the experts")
    ap.add_argument("--router-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                    help="router GEMM precision: bfloat16 (default) is SonicMoE's benchmark "
                         "layer; float32 is pm.Numerics' default (fp32 products, HIGHEST)")
    ap.add_argument("--exact-math", action="store_true",
                    help="the SwiGLU kernels' exp in full precision (KernelConfig approx_math="
                         "False; the default is ex2.approx)")
    ap.add_argument("--gpt-oss", action="store_true",
                    help="expert biases on both projections and the clamped SwiGLU")
    ap.add_argument("--rounds", type=int, default=1,
                    help="then time the dense bound and every variant round-robin this many "
                         "rounds: `paired_vs_bound` = the median over the rounds of the bound's "
                         "time / the step's in the same round")
    ap.add_argument("--gaps", action="store_true",
                    help="also trace 5 back-to-back steps and report the GPU's idle time "
                         "between kernels and its largest gaps (`idle_between_kernels`)")
    args = ap.parse_args()
    log = open_log(args.out, "step_log.txt")
    rows = []
    for name in args.shapes.split(","):
        # The previous shape's arrays go before this shape's are made: in session 60 the
        # 120b shape after 30b ran out of memory in its dense bound with 30B's still held.
        x = router = w1 = w2 = cot = biases = cots = inputs = val = None
        gc.collect()
        shape = SHAPES[name]
        num_tokens, d, n, num_experts, k = shape
        x, router, w1, w2, cot = step_inputs(shape, seed=0)
        biases = step_bias_inputs(shape, 0) if args.gpt_oss else ()
        cots = {"loss": cot, "vjp": cot.astype(jnp.bfloat16)}  # converted outside the step
        _, bound_all, xe, dcot = dense_bound_fns(shape)
        bound_ms = gpu_time_ms(bound_all, xe, w1, w2, dcot, iters=ITERS)
        # --rounds: the bound first, then each variant that ran (row, step, inputs); this keeps
        # the bound's operands alive to the shape's end
        paired = [(None, bound_all, (xe, w1, w2, dcot))] if args.rounds > 1 else []
        del xe, dcot
        gemms, gemm_operands = gemm_bound_fn(shape)
        gemm_bound_ms = gpu_time_ms(gemms, *gemm_operands, w1, w2, iters=ITERS)
        del gemm_operands
        log(f"== {name} {shape} skew {args.skew}: dense fwd+bwd bound {bound_ms:.3f} ms, "
            f"its six GEMMs alone {gemm_bound_ms:.3f} ms")
        reference = {}
        traced = []  # (row, step, inputs) of each variant, for --gaps
        for variant in args.variants.split(","):
            routing, gather, *rest = variant.split("/")
            flags = [r for r in rest if r in CONFIG_FLAGS]  # config changes, in order
            code_flags = [r for r in rest if r in CODE_FLAGS]  # previous code paths
            rest = [r for r in rest if r not in CONFIG_FLAGS and r not in CODE_FLAGS]
            harness = rest[0] if rest else args.harness
            inputs = (x, router, w1, w2, cots[harness], *biases)
            config = KernelConfig.for_shape(d, n, gather=gather, approx_math=not args.exact_math)
            for flag in flags:
                config = CONFIG_FLAGS[flag](config, n)
            step = make_step(shape, routing, "mosaic", config,
                             skew=args.skew, gpt_oss=args.gpt_oss, harness=harness,
                             router_dtype=args.router_dtype)
            for flag in code_flags:
                step = CODE_FLAGS[flag](step)
            flags += code_flags
            variant = "/".join([routing, gather, harness, *flags])
            row = dict(shape=name, routing=routing, gather=" ".join([gather, *flags]),
                       harness=harness,
                       router_dtype=args.router_dtype, approx_math=not args.exact_math,
                       bound_ms=bound_ms, gemm_bound_ms=gemm_bound_ms, gpt_oss=args.gpt_oss)
            try:
                val, grads = step(*inputs)
                finite = all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
                row["finite"] = finite
                if routing not in reference:
                    reference[routing] = (variant, val, grads)
                    if name in args.xla_check.split(","):
                        xval, xgrads = make_step(shape, routing, "xla", None, skew=args.skew,
                                                 gpt_oss=args.gpt_oss, harness=harness,
                                                 router_dtype=args.router_dtype)(*inputs)
                        row["vs_xla"] = [rel_err(g, r) for g, r in zip(grads, xgrads)]
                        del xgrads
                else:
                    ref_variant, _, ref_grads = reference[routing]
                    row[f"vs_{ref_variant}"] = [rel_err(g, r) for g, r in zip(grads, ref_grads)]
                del grads
                row["gpu_ms"] = gpu_time_ms(step, *inputs, iters=ITERS)
                row["wall_ms"] = wall_time_ms(step, *inputs, iters=20)
                row["pipelined_ms"] = pipelined_ms(step, *inputs)
                row["vs_bound"] = bound_ms / row["gpu_ms"]
                row["vs_gemm_bound"] = gemm_bound_ms / row["gpu_ms"]
                row["kernels"] = kernel_breakdown(step, *inputs)
                if args.gaps:  # traced after every variant's CUPTI timings (see below)
                    traced.append((row, step, inputs))
                if args.rounds > 1:
                    paired.append((row, step, inputs))
            except Exception as e:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log("  " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                   for k, v in row.items() if k not in ("kernels", "gaps")}))
            if "kernels" in row:
                top = row["kernels"][:14]
                rest = sum(ms for _, ms, _ in row["kernels"][14:])
                log("    kernels (ms, launches): " + ", ".join(
                    f"{name} {ms:.3f} x{cnt}" for name, ms, cnt in top) + f", other {rest:.3f}")
            rows.append(row)
            with open(os.path.join(args.out, "step.json"), "w") as f:
                json.dump(rows, f, indent=1)
        if len(paired) > 1:  # the card's drift between variants paired out
            clocks = ClockLog()
            timings = interleaved_times_ms([(f, a) for _, f, a in paired], args.rounds,
                                           lambda f, *a: gpu_time_ms(f, *a, iters=ITERS),
                                           clocks)
            seen = clocks.describe(0)[2:] or clocks.unavailable_reason or "no samples"
            log(f"  the bound's clocks: {seen}")
            for i, ((row, _, _), (t, vs_bound, spread)) in enumerate(
                    zip(paired[1:], timings[1:]), start=1):
                row.update(rounds=args.rounds, paired_gpu_ms=t, paired_vs_bound=vs_bound,
                           paired_spread=spread, paired_clocks=clocks.summary(i))
                log(f"  paired over {args.rounds} rounds: {row['routing']}/{row['gather']}/"
                    f"{row['harness']} {t:.3f} ms, {vs_bound:.3f} of the bound "
                    f"({timings[0][0]:.3f} ms), spread {spread:.1%}{clocks.describe(i)}")
        paired.clear()
        # The profiler traces run last: after a `jax.profiler.trace`, the next CUPTI
        # measurement in the process aborted once ("activity records were dropped").
        for row, step, inputs in traced:
            try:
                g = idle_between_kernels(step, *inputs)
            except Exception as e:  # noqa: BLE001 - report and go on
                g = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
            row["gaps"] = g
            log(f"    gaps {row['routing']}/{row['gather']}: " + (g["error"] if "error" in g else (
                f"span {g['span_ms']:.3f} ms/step, busy {g['busy_ms']:.3f}, idle "
                f"{g['idle_ms']:.3f}, {g['events_per_step']:.0f} events/step; "
                "largest (us/step): " +
                "; ".join(f"{a} -> {b} {us:.1f}" for a, b, us in g["top_gaps_us"]) +
                "; running side by side (us/step): " + ("; ".join(
                    f"{a} | {b} {us:.1f}" for a, b, us in g["concurrent_us"]) or "none"))))
        traced.clear()
        with open(os.path.join(args.out, "step.json"), "w") as f:
            json.dump(rows, f, indent=1)
        reference.clear()

    lines = ["| shape | routing | gather | harness | router | step GPU ms | step wall ms "
             "| pipelined ms/step | bound ms | bound/step | GEMMs alone ms | GEMMs/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['routing']} | {r['gather']} | {r['harness']} | "
                         f"{r['router_dtype']} | error: {r['error'][:100]} |")
        else:
            lines.append(f"| {r['shape']} | {r['routing']} | {r['gather']} | {r['harness']} | "
                         f"{r['router_dtype']} | {r['gpu_ms']:.3f} | "
                         f"{r['wall_ms']:.3f} | {r['pipelined_ms']:.3f} | {r['bound_ms']:.3f} | "
                         f"{r['vs_bound']:.2f} | {r['gemm_bound_ms']:.3f} | {r['vs_gemm_bound']:.2f} |")
    if any("paired_gpu_ms" in r for r in rows):
        lines += ["", "Round-robin (`--rounds`): each step and the bound timed once per round.", "",
                  "| shape | routing | gather | harness | rounds | step GPU ms (median) | bound/step, paired | spread |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['routing']} | {r['gather']} | {r['harness']} | {r['rounds']} | "
                  f"{r['paired_gpu_ms']:.3f} | {r['paired_vs_bound']:.3f} | {r['paired_spread']:.1%} |"
                  for r in rows if "paired_gpu_ms" in r]
    table = "\n".join(lines)
    with open(os.path.join(args.out, "step.md"), "w") as f:
        f.write(table + "\n")
    log(table)


if __name__ == "__main__":
    main()
