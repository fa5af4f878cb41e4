"""Forward-kernel benchmark and on-device correctness check (run on an H100).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/forward.py --out $OUT [--shapes 7b,30b]

For each shape (`docs/measured.md`, benchmark shapes; routing = real top-K over random logits, plus skewed
logits) it:
  1. checks every kernel against an XLA reference on fresh random data, over all real rows
     (outputs are produced right after a NaN-filled buffer of the same size is freed, so an
     unwritten row shows up as NaN or garbage instead of an old correct value);
  2. times, with CUPTI (GPU kernel time only): the up-proj, down-proj and aggregation
     kernels, the whole forward (with its per-plan metadata), the dense batched-matmul bound
     of the same FLOPs (`einsum('emd,edn->emn')`, balanced groups), JAX's shipped
     `ragged_dot_mgpu` on the up-proj GEMM (best of a small config sweep, given the
     already-gathered X), an all-XLA forward, and a device copy (bandwidth reference);
  3. prints a table and writes results.json, forward_log.txt and forward_RESULTS.md into
     --out (benchmarks/RESULTS.md is the curated write-up of a run of this script).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.gpu_clocks import ClockLog
from benchmarks.logs import markdown_report, open_log
from jax.experimental.mosaic.gpu import profiler

from pallas_moe.kernels import _common
from pallas_moe.kernels.aggregate import aggregate
from pallas_moe.kernels.down_proj import down_proj
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig
from pallas_moe.kernels.moe_forward import (
    PINGPONG_UP_MAX_D, ForwardConfig, aggregate_width, moe_forward, split_m_up_config,
)
from pallas_moe.kernels.up_proj import UpProjConfig, _cta_cols, interleave_gate_up, up_proj
from pallas_moe.routing.topk import topk_plan

# The card whose defaults a sweep names as the previous ones where an H200's now differ.
H100_KIND = "NVIDIA H100 80GB HBM3"

SHAPES = {
    "7b": (24576, 1536, 256, 128, 8),
    "7b-n512": (24576, 1536, 512, 64, 4),
    "7b-n1024": (24576, 1536, 1024, 32, 2),
    "30b": (32768, 4096, 512, 128, 8),
    "30b-n256": (32768, 4096, 256, 256, 16),
    "30b-n1024": (32768, 4096, 1024, 64, 4),
    "120b-n512": (32768, 4096, 512, 256, 16),
    "120b": (32768, 4096, 1024, 128, 8),
    "120b-n2048": (32768, 4096, 2048, 64, 4),
    # Real widths (d = 2880 is not a multiple of 128; n = 1408 not of 256).
    "w2880": (8192, 2880, 1408, 32, 4),
    "w7168": (8192, 7168, 2048, 16, 2),
    "gpt-oss-20b": (8192, 2880, 2880, 32, 4),  # d = n = 2880; pair with step.py --gpt-oss
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),  # issue 15's widths at a training batch
}
ITERS = 20
FLUSH_MB = 0  # set by --flush-l2: every timed call runs after an XLA pass over this many MB


def gpu_time_ms(f, *args, iters=ITERS, flush_mb=None):
    """Median over `iters` calls of the summed GPU kernel time of one call of f (CUPTI).

    `flush_mb` (default `FLUSH_MB`, set by `--flush-l2`): each timed call of f runs right
    after one XLA kernel that reads and writes a buffer of that many megabytes
    (`flushed_call`), so f finds in the L2 what a step's preceding kernels leave there, not
    the tail of its own previous call; only f's kernels are counted (`kernels_after_flush`)."""
    flush_mb = FLUSH_MB if flush_mb is None else flush_mb
    jax.block_until_ready(f(*args))  # compile + warm up
    if not flush_mb:
        _, times = profiler.measure(f, iterations=iters)(*args)
        return statistics.median(times)
    buf, flush_name = flush_buffer(flush_mb)
    g = flushed_call(f)
    jax.block_until_ready(g(buf, *args))
    _, runs = profiler.measure(g, aggregate=False, iterations=iters)(buf, *args)
    runs = runs if iters > 1 else [runs]
    return statistics.median(kernels_after_flush(run, flush_name) for run in runs)


@functools.lru_cache(maxsize=1)
def flush_buffer(flush_mb: int):
    """(the f32 buffer of `flush_mb` MB, the name of `flush_pass`'s one kernel over it), made
    and measured once per size, not once per timed call."""
    buf = jnp.ones((flush_mb << 18,), jnp.float32)  # MB * 2**20 bytes
    _, flush_kernels = profiler.measure(jax.jit(flush_pass), aggregate=False)(buf)
    if len(flush_kernels) != 1:
        raise RuntimeError(f"the L2 flush should be one kernel, got {flush_kernels}")
    return buf, flush_kernels[0][0]


def flush_pass(buf):
    """The L2 flush: one XLA elementwise kernel reading and writing `buf`. A sine, so that
    its fusion's name ("loop_sine_fusion...") is one no backward kernel shares."""
    return jnp.sin(buf)


@functools.lru_cache(maxsize=64)
def flushed_call(f):
    """jit of `(buf, *args) -> (flush_pass(buf), f(*args))` with f's inputs tied to the flush
    (`optimization_barrier`), so that every kernel of f that reads them runs after it. One
    per f, so a sweep's rounds reuse its compiled program instead of compiling it again."""
    @jax.jit
    def g(buf, *args):
        flushed, args = jax.lax.optimization_barrier((flush_pass(buf), args))
        return flushed, f(*args)

    return g


def kernels_after_flush(run, flush_name: str) -> float:
    """The summed ms of one flushed call's kernels `[(name, ms)]` without the flush, found by
    its fusion name less XLA's numeric suffix (`loop_sine_fusion_2` is `loop_sine_fusion`).
    Exactly one kernel must match: none or several is an error, never a figure that
    silently counts the flush or drops one of f's kernels."""
    base = lambda name: re.sub(r"_\d+$", "", name.split("(")[0])  # noqa: E731
    matches = [i for i, (name, _) in enumerate(run) if base(name) == base(flush_name)]
    if len(matches) != 1:
        raise RuntimeError(f"expected one L2 flush kernel {flush_name!r} in {run}")
    return sum(ms for i, (_, ms) in enumerate(run) if i != matches[0])


def interleaved_times_ms(calls, rounds, time_ms=None, clocks=None):
    """Times each `(f, args)` of `calls` round-robin, `rounds` times over, with `time_ms(f,
    *args)` (default `gpu_time_ms`), so that a drift of the card's clocks between configs
    (sessions 37-38 saw the same config 7% apart in two runs on one machine) lands on all of
    them alike. Returns, per call, `(median ms over the rounds, median over the rounds of
    calls[0]'s time / this call's time in the same round, (max - min) / median of its own
    rounds)`: the middle one is the paired speed-up over the first call. `clocks` (a
    `gpu_clocks.ClockLog`, optional): the card's clocks are sampled under key i while call i
    is timed, so a drift the pairing hides can still be seen."""
    time_ms = time_ms or gpu_time_ms
    per = [[] for _ in calls]
    for _ in range(rounds):
        for i, (times, (f, args)) in enumerate(zip(per, calls)):
            with clocks.sampling(i) if clocks is not None else contextlib.nullcontext():
                times.append(time_ms(f, *args))
    return [(statistics.median(t), statistics.median(a / b for a, b in zip(per[0], t)),
             (max(t) - min(t)) / statistics.median(t)) for t in per]


def sweep(name, configs, build, check, flops, log, rounds=1, time_ms=None, tol=2e-2):
    """Checks each config's call, `f, args = build(cfg)`, with `check(f, args)` (a relative
    error against the reference, on poisoned outputs), then times the correct ones
    round-robin over `rounds` rounds (`interleaved_times_ms`; the first config is the
    baseline of the paired speed-ups). Returns `((best ms, best config), rows)`; a config
    that fails to build or lower is logged and skipped, a wrong one is logged, never timed."""
    calls, rows = [], []
    for cfg in configs:
        try:
            f, args = build(cfg)
            err = check(f, args)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
            log(f"  {name} {cfg}: failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        if not err < tol:
            log(f"  {name} {cfg}: WRONG (err {err:.2e}), not timed")
            rows.append(dict(config=str(cfg), err=err))
            continue
        calls.append((cfg, f, args, err))
    best = (float("inf"), None)
    if not calls:
        return best, rows
    clocks = ClockLog()
    timings = interleaved_times_ms([(f, args) for _, f, args, _ in calls], rounds, time_ms,
                                   clocks)
    for i, ((cfg, _, _, err), (t, speedup, spread)) in enumerate(zip(calls, timings)):
        paired = (f", x{speedup:.3f} of the first over {rounds} rounds (spread {spread:.1%})"
                  if rounds > 1 else "")
        log(f"  {name} {cfg}: {t * 1e3:.1f} us, {flops / t / 1e9:.0f} TFLOP/s, err {err:.1e}"
            f"{paired}{clocks.describe(i)}")
        rows.append(dict(config=str(cfg), us=t * 1e3, err=err, speedup_vs_first=speedup,
                         spread=spread, clocks=clocks.summary(i)))
        if t < best[0]:
            best = (t, cfg)
    return best, rows


def wall_time_ms(f, *args, iters=ITERS):
    """Median over `iters` calls of the wall milliseconds of one call of f, blocking on the
    result (launch gaps and host work included), after a warm-up call."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def pipelined_ms(f, *args, steps=10, repeats=5):
    """Milliseconds per call of `steps` calls dispatched back to back with one block at the
    end (median of `repeats`), after a warm-up: what a training loop that does not wait on
    each step sees. Against `wall_time_ms` it separates one call's host dispatch latency
    (hidden here behind the previous calls' GPU work) from gaps inside the GPU's work."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(steps)]
        jax.block_until_ready(outs)
        times.append(1e3 * (time.perf_counter() - t0) / steps)
        del outs
    return statistics.median(times)


def poison_then(f, *args, nbytes):
    """Runs f after freeing a NaN-filled buffer of `nbytes`, so fresh outputs start dirty."""
    junk = jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16)
    junk.block_until_ready()
    del junk
    return jax.block_until_ready(f(*args))


def rel_err(got, want, rows):
    g = np.asarray(got[:rows], np.float32)
    w = np.asarray(want[:rows], np.float32)
    if not np.all(np.isfinite(g)):
        return float("inf")
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def reference_tiles(x, plan, w1, w2, block_m=128, tiles_per_step=8):
    """XLA reference of H [P, 2n], A [P, n], Y [P, d] (grouped rows) and O [T, d]."""
    from pallas_moe.ops.xla import scan_row_tiles, swiglu

    num_tokens, d = x.shape
    cap = plan.capacity
    n = w1.shape[2] // 2
    dtype = x.dtype

    def step(carry, rows, valid, tok, s, e):
        h_all, a_all, y_all, out = carry
        h = jnp.einsum("cmd,cdf->cmf", x[tok], w1[e], preferred_element_type=jnp.float32)
        h = h.astype(dtype)
        a = swiglu(h).astype(dtype)
        y = jnp.einsum("cmn,cnd->cmd", a, w2[e], preferred_element_type=jnp.float32).astype(dtype)
        r = jnp.where(valid, rows, cap).reshape(-1)
        h_all = h_all.at[r].set(h.reshape(-1, 2 * n), mode="drop")
        a_all = a_all.at[r].set(a.reshape(-1, n), mode="drop")
        y_all = y_all.at[r].set(y.reshape(-1, d), mode="drop")
        out = out.at[tok.reshape(-1)].add((y.astype(jnp.float32) * s[..., None]).reshape(-1, d))
        return h_all, a_all, y_all, out

    init = (
        jnp.zeros((cap, 2 * n), dtype), jnp.zeros((cap, n), dtype), jnp.zeros((cap, d), dtype),
        jnp.zeros((num_tokens, d), jnp.float32),
    )
    h, a, y, out = scan_row_tiles(plan, step, init, block_m=block_m, tiles_per_step=tiles_per_step)
    return h, a, y, out.astype(dtype)


def make_case(shape, skew: bool, seed: int):
    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (T, d), jnp.float32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[3], (T, E), jnp.float32)
    if skew:
        # A quarter of the experts are strongly preferred: group sizes spread ~10x.
        logits = logits + jnp.where(jnp.arange(E) < E // 4, 1.5, 0.0)
    plan = jax.jit(lambda l: topk_plan(l, K, score="softmax_topk"))(logits)
    return x, w1, w2, plan


def dense_bound_ms(shape):
    """Balanced batched matmuls with the forward's FLOPs: up [E,m,d]x[E,d,2n], down [E,m,n]x[E,n,d]."""
    T, d, n, E, K = shape
    m = T * K // E
    ks = jax.random.split(jax.random.key(7), 4)
    a1 = jax.random.normal(ks[0], (E, m, d), jnp.bfloat16)
    b1 = jax.random.normal(ks[1], (E, d, 2 * n), jnp.bfloat16)
    a2 = jax.random.normal(ks[2], (E, m, n), jnp.bfloat16)
    b2 = jax.random.normal(ks[3], (E, n, d), jnp.bfloat16)
    bmm = jax.jit(lambda a, b: jnp.einsum("emd,edn->emn", a, b))
    return gpu_time_ms(bmm, a1, b1), gpu_time_ms(bmm, a2, b2)


def ragged_dot_best_ms(xg, w1, group_sizes, log):
    """JAX's shipped Hopper ragged_dot on [P, d] x [E, d, 2n], best of a small sweep."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    best = (float("inf"), None)
    two_n = w1.shape[2]
    for bm, bn, steps, gbn in [(128, 128, 4, 1), (128, 256, 4, 1), (64, 256, 4, 1),
                               (128, 128, 5, 4), (128, 256, 3, 2)]:
        if two_n % (bn * gbn):
            continue
        cfg = dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps, grid_block_n=gbn)
        try:
            f = jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=group_sizes, **cfg))
            t = gpu_time_ms(f, xg, w1, iters=10)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
            log(f"  ragged_dot {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        log(f"  ragged_dot {cfg}: {t * 1e3:.1f} us")
        if t < best[0]:
            best = (t, cfg)
    return best


def run_shape(name, shape, skew, up_cfgs, down_cfgs, log, baselines=True, rounds=1):
    T, d, n, E, K = shape
    # The dense bound first, before the shape's own arrays exist: at 30b-n256 (P = 524,288
    # rows) its 4-GiB operands no longer fitted next to them on an H200 (session 29).
    t_up_bmm, t_dn_bmm = dense_bound_ms(shape)
    x, w1, w2, plan = make_case(shape, skew, seed=hash((name, skew)) % 1000)
    P = plan.capacity
    rows = int(plan.num_rows)
    gs = np.asarray(plan.group_sizes)
    res = dict(name=name, skew=skew, T=T, d=d, n=n, E=E, K=K, P=P,
               group_min=int(gs.min()), group_max=int(gs.max()))
    log(f"== {name} skew={skew} (T,d,n,E,K)={shape} groups [{gs.min()}, {gs.max()}]")
    flops_up = 2 * P * d * 2 * n
    flops_down = 2 * P * n * d

    h_ref, a_ref, y_ref, o_ref = jax.jit(reference_tiles)(x, plan, w1, w2)
    jax.block_until_ready(o_ref)

    # ---- correctness, every kernel alone and chained, all real rows
    base = ForwardConfig.for_shape(d, n)
    up_meta = jax.jit(lambda g, t: _common.tile_meta(g, t, base.up.tile_rows))(plan.group_sizes, plan.token_ids)
    up_fn = jax.jit(lambda x, t, g, w, m: up_proj(x, t, g, w, config=base.up, meta=m))
    h, a = poison_then(up_fn, x, plan.token_ids, plan.group_sizes, w1, up_meta, nbytes=P * 3 * n * 2)
    res["err_h"] = rel_err(h, h_ref, rows)
    res["err_a"] = rel_err(a, a_ref, rows)
    dn_fn = jax.jit(lambda a, g, w: down_proj(a, g, w, config=base.down))
    y = poison_then(dn_fn, a_ref, plan.group_sizes, w2, nbytes=P * d * 2)
    res["err_y"] = rel_err(y, y_ref, rows)
    ag_fn = jax.jit(lambda y, r, o, s: aggregate(y, r, o, s, config=dataclasses.replace(base.aggregate)))
    if aggregate_width(d) == d:
        o = poison_then(ag_fn, y_ref, plan.rows_by_token, plan.token_row_offsets, plan.scores, nbytes=T * d * 2)
        res["err_agg"] = rel_err(o, o_ref, T)
        o2 = ag_fn(y_ref, plan.rows_by_token, plan.token_row_offsets, plan.scores)
        res["agg_bitwise_repeat"] = bool(np.array_equal(np.asarray(o), np.asarray(o2)))
    fwd = jax.jit(lambda x, p, w1, w2: moe_forward(x, p, w1, w2, config=base))
    out, h2 = poison_then(fwd, x, plan, w1, w2, nbytes=P * (3 * n + d) * 2)
    res["err_out"] = rel_err(out, o_ref, T)
    res["err_fwd_h"] = rel_err(h2, h_ref, rows)
    log("  errors: " + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in res.items() if k.startswith(("err", "agg_bit"))))
    ok = all(v < 2e-2 for k, v in res.items() if k.startswith("err"))
    res["correct"] = bool(ok)
    # The checked outputs go before the timings: at 30b-n256 a [P, d] array is 4 GiB, and
    # session 29's run ran out of memory in the copy baseline with them still alive.
    del h, a, y, out, h2

    # ---- timings: each sweep checks its configs first, then times them round-robin
    def build_up(cfg):
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.tile_rows))(plan.group_sizes, plan.token_ids)
        if cfg.fused_gate_up:
            # One N = 2 * block_n wgmma per K step on W1 interleaved per block_n (the only
            # layout the fused form reads, one box per step), interleaved once here,
            # outside the timing.
            w = jax.jit(lambda w: interleave_gate_up(w, cfg.block_n))(w1)
            f = jax.jit(lambda x, t, g, w, m: up_proj(x, t, g, w, config=cfg, meta=m,
                                                      gate_up_blocks=cfg.block_n))
            return f, (x, plan.token_ids, plan.group_sizes, w, meta)
        f = jax.jit(lambda x, t, g, w, m: up_proj(x, t, g, w, config=cfg, meta=m))
        return f, (x, plan.token_ids, plan.group_sizes, w1, meta)

    def check_up(f, args):
        hh, aa = poison_then(f, *args, nbytes=P * 3 * n * 2)
        return max(rel_err(hh, h_ref, rows), rel_err(aa, a_ref, rows))

    def build_down(cfg):
        meta = jax.jit(lambda g: _common.aligned_tile_meta(g, P, cfg.tile_rows))(plan.group_sizes)
        f = jax.jit(lambda a, g, w, m: down_proj(a, g, w, config=cfg, meta=m))
        return f, (a_ref, plan.group_sizes, w2, meta)

    def check_down(f, args):
        return rel_err(poison_then(f, *args, nbytes=P * d * 2), y_ref, rows)

    best_up, res["up_sweep"] = sweep("up", up_cfgs(d, n), build_up, check_up, flops_up, log, rounds)
    best_dn, res["down_sweep"] = sweep("down", down_cfgs(d, n), build_down, check_down, flops_down,
                                       log, rounds)
    res["up_us"] = best_up[0] * 1e3
    res["up_cfg"] = str(best_up[1])
    res["down_us"] = best_dn[0] * 1e3
    res["down_cfg"] = str(best_dn[1])
    ypad = jnp.pad(y_ref, ((0, 0), (0, aggregate_width(d) - d)))
    res["agg_us"] = gpu_time_ms(ag_fn, ypad, plan.rows_by_token, plan.token_row_offsets, plan.scores) * 1e3
    agg_bytes = rows * aggregate_width(d) * 2 + T * aggregate_width(d) * 2 + rows * 12 + T * 4
    res["agg_GBs"] = agg_bytes / (res["agg_us"] * 1e-6) / 1e9
    del ypad
    copy_src = jax.random.normal(jax.random.key(3), (P, d), jnp.bfloat16)
    t_copy = gpu_time_ms(jax.jit(lambda v: v + 1), copy_src)
    res["copy_GBs"] = 2 * P * d * 2 / (t_copy * 1e-3) / 1e9
    del copy_src
    fwd_up = best_up[1] or base.up
    if fwd_up.fused_gate_up:
        # moe_forward passes W1's halves, which the fused up-proj does not read
        # (`ForwardConfig` rejects it): the whole forward times the default's up-proj.
        log(f"  forward: the fastest up-proj {fwd_up} reads interleaved W1 only; timing the "
            "forward with the default's")
        fwd_up = base.up
    best_cfg = ForwardConfig(up=fwd_up, down=best_dn[1] or base.down, aggregate=base.aggregate)
    fwd_best = jax.jit(lambda x, p, w1, w2: moe_forward(x, p, w1, w2, config=best_cfg))
    res["fwd_us"] = gpu_time_ms(fwd_best, x, plan, w1, w2) * 1e3
    res["bmm_up_us"], res["bmm_down_us"] = t_up_bmm * 1e3, t_dn_bmm * 1e3
    xg = x[plan.token_ids]
    rd_t, rd_cfg = (ragged_dot_best_ms(xg, w1, plan.group_sizes, log) if baselines
                    else (float("nan"), None))
    res["ragged_dot_up_us"], res["ragged_dot_cfg"] = rd_t * 1e3, str(rd_cfg)
    from pallas_moe.ops.xla import moe_ffn_xla

    try:
        if not baselines:
            raise RuntimeError("skipped (--no-baselines)")
        res["xla_fwd_us"] = gpu_time_ms(jax.jit(moe_ffn_xla), x, plan, w1, w2, iters=5) * 1e3
    except Exception as e:  # noqa: BLE001
        log(f"  xla forward failed: {type(e).__name__}: {str(e)[:200]}")
        res["xla_fwd_us"] = float("nan")
    res["up_tflops"] = flops_up / (res["up_us"] * 1e-6) / 1e12
    res["down_tflops"] = flops_down / (res["down_us"] * 1e-6) / 1e12
    res["fwd_tflops"] = (flops_up + flops_down) / (res["fwd_us"] * 1e-6) / 1e12
    res["up_vs_bmm"] = res["bmm_up_us"] / res["up_us"]
    res["down_vs_bmm"] = res["bmm_down_us"] / res["down_us"]
    res["fwd_vs_bmm"] = (res["bmm_up_us"] + res["bmm_down_us"]) / res["fwd_us"]
    res["up_vs_ragged_dot"] = res["ragged_dot_up_us"] / res["up_us"]
    res["fwd_vs_xla"] = res["xla_fwd_us"] / res["fwd_us"]
    res["agg_vs_copy"] = res["agg_GBs"] / res["copy_GBs"]
    log("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}))
    return res


def variant_up_cfgs(d, n):
    """Up-proj design variants (single warpgroup vs warp-specialized, lowering knobs)."""
    out = []
    for cons, bn, stages in [(2, 128, 3), (2, 64, 2), (2, 64, 3), (1, 128, 4), (1, 128, 3)]:
        if n % (cons * bn) == 0:
            out.append(UpProjConfig(block_n=bn, num_stages=stages, num_consumers=cons))
    if n % 256 == 0:
        out.append(UpProjConfig(block_n=128, num_stages=3, num_consumers=2, no_auto_barriers=True))
        out.append(UpProjConfig(block_n=128, num_stages=3, num_consumers=2, row_unroll=16))
    # (Two producer warpgroups, 3x slower on the H100 in session 2, were removed in session 41.)
    return out


def variant_down_cfgs(d, n):
    """Down-proj variants: split-M (128-row) items' widths and stages. (Session 64 removed
    the 64-row ping-pong items, `block_m=64`: 0.667x at gpt-oss in session 49.)"""
    out = []
    for bn, stages in [(256, 3), (128, 4), (192, 3)]:
        if d % bn == 0:
            out.append(GroupedMatmulConfig(block_m=128, block_n=bn, num_stages=stages))
    return out


def staged_down_cfgs(d, n):
    """The default down-proj, the H100's (the whole output tile staged: the H200's default
    until session 37), one output slab staged at a time (`out_slabs=1`), and one slab with
    the stage that frees (the 128-row ping-pong: 6 stages of 32 KB beside 2 x 16 KB of
    staged slabs instead of 5 beside the whole 2 x 32-KB tiles; session 36 gave the fp8
    up-proj 1.03x at 30B this way); each config once, in that order. (Session 64 removed
    the ring of two staged slabs, `out_buffers=2`: level on both cards.)"""
    base = ForwardConfig.for_shape(d, n).down
    whole = ForwardConfig.for_shape(d, n, device_kind=H100_KIND).down
    rep = dataclasses.replace
    return unique_configs([base, whole, rep(whole, out_slabs=1),
                           rep(whole, out_slabs=1, num_stages=whole.num_stages + 1)])


def unique_configs(configs):
    """`configs` without repeats, in their first order."""
    return list(dict.fromkeys(configs))


def default_up_cfgs(d, n):
    """The forward's default, the other card's default (session 44's sweep on an H100 lacked
    it: its split-M entries load rows by TMA, the H200's default by cp.async) and the
    competing designs (see benchmarks/history/)."""
    cands = [
        ForwardConfig.for_shape(d, n).up,
        ForwardConfig.for_shape(d, n, device_kind=other_card_kind()).up,
        UpProjConfig(block_m=64, block_n=128, num_stages=3, num_consumers=2),  # split N
        split_m_up_config(132),  # split M: persistent 128-row items
        dataclasses.replace(split_m_up_config(132), num_stages=3),
        UpProjConfig(block_m=64, block_n=128, num_stages=4, num_consumers=1),
    ]
    return _fitting_up_cfgs(cands, n)


def _fitting_up_cfgs(cands, n):
    """The distinct up-proj configs whose CTA column block divides n."""
    out = []
    for cfg in cands:
        if n % _cta_cols(cfg) == 0 and cfg not in out:
            out.append(cfg)
    return out


def gather_up_cfgs(d, n):
    """The TMA row gather against the cp.async gather (the default), several tile shapes."""
    cands = [ForwardConfig.for_shape(d, n, gather="tma").up]
    for bm, bn, stages, cons in [(64, 128, 3, 2), (64, 64, 5, 2), (64, 64, 4, 2),
                                 (64, 128, 4, 1)]:
        cands.append(UpProjConfig(block_m=bm, block_n=bn, num_stages=stages,
                                  num_consumers=cons, gather="cp_async"))
    cands.append(dataclasses.replace(split_m_up_config(132), gather="cp_async"))  # split M
    return _fitting_up_cfgs(cands, n)


def registers_up_cfgs(d, n):
    """The default (consumers take the producer's registers) against the even register split
    of the previous version, and the (persistent) split-M tiles the extra registers allow."""
    base = ForwardConfig.for_shape(d, n).up
    cands = [base, dataclasses.replace(base, rebalance_registers=False)]
    for stages in (4, 3):
        cands.append(dataclasses.replace(split_m_up_config(132), num_stages=stages,
                                         gather=base.gather))
    return _fitting_up_cfgs(cands, n)


def approx_up_cfgs(d, n):
    """Session 8: the SwiGLU epilogue's exp as ex2.approx (`approx_math`, the default since
    session 12) against the full-precision exp."""
    base = ForwardConfig.for_shape(d, n).up
    return _fitting_up_cfgs([base, dataclasses.replace(base, approx_math=not base.approx_math)], n)


def audit_up_cfgs(d, n):
    """The audit list (session 63's, still open after session 64: options kept without a
    measurement on today's kernels; time them, then remove the losers): `UpProjConfig.no_auto_barriers=True` and
    `rebalance_registers=False` were only ever timed on kernels since removed (the v1
    up-proj; session 3's cooperative kernel, where the even register split was 1.001x at 7B
    and 0.964x at 30B), never on today's defaults (the ping-pong at d <= 1536, split-M
    items above, on clusters from d = 2880). Both against this width's default, each alone.

    `row_unroll` (the unroll factor of the producer warps' one-row TMA copy loop) is read
    only by the TMA row gather (`gather="tma"`), which no compiled default runs
    (`ForwardConfig.for_shape` sets "cp_async"; interpret mode always runs the TMA loader,
    where speed does not count). So its pair is this width's default on the TMA loader
    (`for_shape(gather="tma")`, row_unroll 4) against the same with `row_unroll=16`: their
    ratio is the knob's worth; both against the first config are the loaders' (the TMA
    gather was 0.92x / 0.87x of cp.async at 7B / 30B on the H100 in session 2, on the
    cooperative kernel)."""
    base = ForwardConfig.for_shape(d, n).up
    tma = ForwardConfig.for_shape(d, n, gather="tma").up
    rep = dataclasses.replace
    return _fitting_up_cfgs([base, rep(base, no_auto_barriers=True),
                             rep(base, rebalance_registers=False),
                             tma, rep(tma, row_unroll=16)], n)


def completion_up_cfgs(d, n):
    """Hardware-tracked cp.async stages (the default, `gather_completion="mbarrier"`) against
    the previous lagged publish ("wait_group"), and the 128-row split-M tiles that may pay
    now that every stage can be in flight."""
    base = ForwardConfig.for_shape(d, n).up
    cands = [base, dataclasses.replace(base, gather_completion="wait_group")]
    for bm, bn, stages in [(128, 128, 4), (128, 128, 3)]:
        cands.append(UpProjConfig(block_m=bm, block_n=bn, num_stages=stages, num_consumers=2,
                                  gather="cp_async"))
    return _fitting_up_cfgs(cands, n)


def cooperative_up_cfg(n):
    """`ForwardConfig.for_shape`'s up-proj before the ping-pong kernel (session 19), and
    above d = 1536 until the split-M kernel (session 24 on an H200, session 45 on the H100;
    still the default above d = 4096): one CTA per tile."""
    if n % 256 == 0:
        return UpProjConfig(block_n=128, num_stages=3, num_consumers=2, gather="cp_async")
    if n % 128 == 0:
        return UpProjConfig(block_n=128, num_stages=4, num_consumers=1, gather="cp_async")
    return UpProjConfig(block_n=64, num_stages=4, num_consumers=1, gather="cp_async")


def pingpong_up() -> UpProjConfig:
    """The ping-pong up-proj as `ForwardConfig.for_shape` builds it at d <= 1536 on this
    device. A function, not a module constant: `for_shape` asks JAX for the device, which
    starts the backends, after which XLA ignores XLA_FLAGS (benchmarks/ep.py sets a flag
    after its imports)."""
    return ForwardConfig.for_shape(1536, 256, num_sms=132).up


def __getattr__(name):
    # `PINGPONG_UP`, the name earlier sessions' scripts (benchmarks/history/) import.
    if name == "PINGPONG_UP":
        return pingpong_up()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def other_card_kind() -> str:
    """The card whose defaults the `cards` sweeps time on this one: the H100's on an H200,
    else the H200's."""
    return H100_KIND if "H200" in jax.devices()[0].device_kind else "NVIDIA H200"


def cards_up_cfgs(d, n):
    """Session 43: this card's default up-proj against the other card's (on the H100 the
    H200's persistent split-M items where it takes them; on the H200 the H100's), and the
    cooperative kernel (the H100's default above d = 1536 until session 45, where both
    cards now take the split-M kernel)."""
    return _fitting_up_cfgs([ForwardConfig.for_shape(d, n).up,
                             ForwardConfig.for_shape(d, n, device_kind=other_card_kind()).up,
                             cooperative_up_cfg(n)], n)


def split_m_up_cfg(n, rows=None):
    """The split-M up-proj as `ForwardConfig.for_shape` builds it (`split_m_up_config` on
    132 CTAs, the cp.async gather), with `rows`-row items if given."""
    return dataclasses.replace(split_m_up_config(132, n, rows=rows), gather="cp_async")


def persistent_up_cfgs(d, n):
    """Session 48: can the persistent kernel be the only up-proj? This width's default
    against split-M items (128-row items shared by both consumers; `block_n` = 128, or 64
    where 128 does not divide n), the ping-pong (64-row items) at d <= 1536, and the
    cooperative kernel (one CTA per tile: the default above d = 4096, and where 128 does not
    divide n until session 48, whose run of this sweep found split-M 1.433x at gpt-oss's
    widths and 0.854x at d = 7168)."""
    split = split_m_up_cfg(n)
    cands = [ForwardConfig.for_shape(d, n).up, split, cooperative_up_cfg(n)]
    if split.block_n == 64:  # one N = 128 wgmma per K step instead of two of N = 64
        cands.append(dataclasses.replace(split, fused_gate_up=True))
    if d <= PINGPONG_UP_MAX_D:
        ping = pingpong_up()
        cands.append(ping if n % ping.block_n == 0 else dataclasses.replace(ping, block_n=64))
    return _fitting_up_cfgs(cands, n)


def rows_up_cfgs(d, n):
    """Session 49: split-M items of 192 rows, three consumers (64 rows each) sharing each
    weight tile, against 128-row split-M items (this width's default at 1536 < d <= 4096).
    Each weight tile then feeds 192 rows: at gpt-oss's widths (64-column items) the counted
    L2 -> SMEM traffic drops from ~17 GB to ~14 GB per call."""
    return _fitting_up_cfgs(
        [ForwardConfig.for_shape(d, n).up] + [split_m_up_cfg(n, rows=r) for r in (128, 192)], n)


def cluster_up_cfgs(d, n):
    """Session 49: split-M items on clusters of two CTAs that share each weight tile by
    multicast (`UpProjConfig.cluster_m=2`): each weight byte from L2 feeds twice the rows.
    Against this width's default and its split-M form without clusters (at d <= 1536 and
    above 4096, where the default is not split-M, both split-M forms are the candidates)."""
    split = split_m_up_cfg(n)
    return _fitting_up_cfgs([ForwardConfig.for_shape(d, n).up, split,
                             dataclasses.replace(split, cluster_m=2)], n)


def depth_up_cfgs(d, n):
    """Session 51: does pipeline depth limit the split-M up-proj? (Its stall samples at 30B
    had both the producer and the consumers waiting on each other.) This width's default
    (128 x 128 items, 4 stages of 48 KB) against 3 stages of the same, and 64-column items
    (32 KB stages) with 6 stages, with two N = 64 wgmmas or one fused N = 128, and the
    gpt-oss form (192 x 64 items, 4 stages). Split-M widths only."""
    base = ForwardConfig.for_shape(d, n).up
    if base.block_m == 64 or n % 128:
        return [base]
    narrow = dataclasses.replace(base, block_n=64, num_stages=6)
    return [base, dataclasses.replace(base, num_stages=3), narrow,
            dataclasses.replace(narrow, fused_gate_up=True),
            dataclasses.replace(base, block_m=192, num_consumers=3, block_n=64)]


def lag_up_cfgs(d, n):
    """Session 51: this width's default against the same with each slot released as soon
    as its own K step's wgmmas are done (`UpProjConfig.wgmma_lag=0`: one more slot loading,
    the tensor cores idle between steps unless the other consumer fills them). 3 stages
    instead of 4 cost the 30B up-proj 0.878x (`--up-sweep depth`), so a slot more in flight
    may be worth the idle gaps."""
    base = ForwardConfig.for_shape(d, n).up
    return [base, dataclasses.replace(base, wgmma_lag=0)]


def pingpong_up_cfgs(d, n):
    """Session 20: the ping-pong up-proj (`UpProjConfig.pingpong_ctas`, the default for
    d <= 1536) against the cooperative kernel (the previous default, and still the default
    at wider d)."""
    return _fitting_up_cfgs([ForwardConfig.for_shape(d, n).up, cooperative_up_cfg(n),
                             pingpong_up()], n)


def lag_down_cfgs(d, n):
    """Session 51: the default down-proj against the same with each slot released as soon
    as its own K step's wgmmas are done (`GroupedMatmulConfig.wgmma_lag=0`)."""
    base = ForwardConfig.for_shape(d, n).down
    return [base, dataclasses.replace(base, wgmma_lag=0)]


def default_down_cfgs(d, n):
    cands = [
        ForwardConfig.for_shape(d, n).down,
        GroupedMatmulConfig(block_m=128, block_n=256, num_stages=3, num_sms=132),  # split M
        GroupedMatmulConfig(block_m=128, block_n=128, num_stages=4, num_sms=132),
        GroupedMatmulConfig(block_m=128, block_n=192, num_stages=3, num_sms=132),
        # (Session 64 removed the 64-row ping-pong items, 256 or 192 wide: 0.667x / 0.640x
        # the split-M 128 x 192 default at gpt-oss's widths on the H100 in session 49.)
    ]
    return [c for i, c in enumerate(cands) if d % c.block_n == 0 and c not in cands[:i]]


TABLE_COLS = [
    ("shape", lambda r: f"{r['name']}{' skew' if r['skew'] else ''}"),
    ("ok", lambda r: "yes" if r["correct"] else "NO"),
    ("up us", lambda r: f"{r['up_us']:.0f}"),
    ("up TF/s", lambda r: f"{r['up_tflops']:.0f}"),
    ("up/bmm", lambda r: f"{r['up_vs_bmm']:.2f}"),
    ("up/ragged_dot", lambda r: f"{r['up_vs_ragged_dot']:.2f}"),
    ("down us", lambda r: f"{r['down_us']:.0f}"),
    ("down TF/s", lambda r: f"{r['down_tflops']:.0f}"),
    ("down/bmm", lambda r: f"{r['down_vs_bmm']:.2f}"),
    ("agg us", lambda r: f"{r['agg_us']:.0f}"),
    ("agg GB/s", lambda r: f"{r['agg_GBs']:.0f}"),
    ("agg/copy", lambda r: f"{r['agg_vs_copy']:.2f}"),
    ("fwd us", lambda r: f"{r['fwd_us']:.0f}"),
    ("fwd TF/s", lambda r: f"{r['fwd_tflops']:.0f}"),
    ("fwd/bmm", lambda r: f"{r['fwd_vs_bmm']:.2f}"),
    ("xla fwd us", lambda r: f"{r['xla_fwd_us']:.0f}"),
    ("fwd speedup vs xla", lambda r: f"{r['fwd_vs_xla']:.1f}"),
]


def markdown(results, cmd, device):
    lines = markdown_report(
        f"Forward kernels on {device}", f"GPU kernel time (CUPTI), median of {ITERS} calls.", cmd,
        "Ratios: `x/bmm` = balanced dense batched-matmul time for the same FLOPs / our time "
        "(1.0 = as fast as the bound); `up/ragged_dot` = JAX `ragged_dot_mgpu` time (best of a "
        "small sweep, on pre-gathered X) / our up-proj time (gather fused); `agg/copy` = "
        "aggregation bytes/s over a device copy's bytes/s; `fwd` includes per-plan metadata.",
        TABLE_COLS, results, lambda r: f"| {r.get('name')} | failed: {r.get('error', '?')} |",
    )
    lines.append("")
    lines.append("Chosen configs: " + "; ".join(
        f"{r['name']}{' skew' if r['skew'] else ''}: up {r.get('up_cfg')}, down {r.get('down_cfg')}, "
        f"ragged_dot {r.get('ragged_dot_cfg')}" for r in results if "up_cfg" in r))
    return "\n".join(lines) + "\n"


def main():
    global FLUSH_MB
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default="7b,30b")
    p.add_argument("--skew", default="7b", help="shapes also run with skewed routing")
    p.add_argument("--up-sweep", default="default", choices=["default", "variants", "gather", "registers", "completion", "approx", "pingpong", "cards", "persistent", "rows", "cluster", "depth", "lag", "audit", "none"])
    p.add_argument("--down-sweep", default="default", choices=["default", "variants", "slabs", "lag", "none"])
    p.add_argument("--no-baselines", action="store_true", help="skip ragged_dot and XLA forward")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each sweep's configs round-robin this many rounds (the median, "
                        "and paired speed-ups over the sweep's first config)")
    p.add_argument("--flush-l2", type=int, default=0, metavar="MB",
                   help="time every call right after an XLA pass over this many MB (e.g. 256; "
                        "the H200's L2 holds 50), counting only the call's own kernels")
    args = p.parse_args()
    FLUSH_MB = args.flush_l2
    log = open_log(args.out, "forward_log.txt")
    device = jax.devices()[0].device_kind
    results = []
    skews = set(s for s in args.skew.split(",") if s)
    for name in args.shapes.split(","):
        for skew in ([False, True] if name in skews else [False]):
            try:
                up_cfgs = {"variants": variant_up_cfgs, "default": default_up_cfgs,
                           "gather": gather_up_cfgs, "registers": registers_up_cfgs,
                           "completion": completion_up_cfgs,
                           "approx": approx_up_cfgs, "pingpong": pingpong_up_cfgs,
                           "cards": cards_up_cfgs,
                           "persistent": persistent_up_cfgs,
                           "rows": rows_up_cfgs,
                           "cluster": cluster_up_cfgs,
                           "depth": depth_up_cfgs,
                           "lag": lag_up_cfgs,
                           "audit": audit_up_cfgs,
                           "none": lambda d, n: [ForwardConfig.for_shape(d, n).up]}[args.up_sweep]
                down_cfgs = {"variants": variant_down_cfgs, "default": default_down_cfgs,
                             "slabs": staged_down_cfgs, "lag": lag_down_cfgs, "none": lambda d, n: [ForwardConfig.for_shape(d, n).down]}[args.down_sweep]
                results.append(run_shape(name, SHAPES[name], skew, up_cfgs, down_cfgs, log,
                                         baselines=not args.no_baselines, rounds=args.rounds))
            except Exception as e:  # noqa: BLE001 - report and go on to the next shape
                log(f"{name} skew={skew}: FAILED {type(e).__name__}: {e}")
                log(traceback.format_exc()[-3000:])
                results.append(dict(name=name, skew=skew, error=f"{type(e).__name__}: {str(e)[:200]}"))
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(dict(device=device, results=results), f, indent=1)
    cmd = "PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/forward.py " + " ".join(sys.argv[1:])
    md = markdown(results, cmd, device)
    with open(os.path.join(args.out, "forward_RESULTS.md"), "w") as f:
        f.write(md)
    log(md)


if __name__ == "__main__":
    main()
