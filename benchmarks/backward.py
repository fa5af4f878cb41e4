"""Backward-kernel benchmark and on-device correctness check (run on an H100).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/backward.py [--out DIR] [--shapes 7b,30b]
    PYTHONPATH=. python3 benchmarks/backward.py --smoke      # CPU: interpret mode, tiny shape

For each shape (routing = real top-K over random router logits; `7b-skew`/`30b-skew` add +1.5
to the logits of a quarter of the experts; `7b-router`/`30b-router` route as `step.py` does,
through a bf16 router layer over x) it:
  1. checks every backward kernel against XLA on fresh random data: the dH kernel (dH, A',
     dS), both weight-gradient kernels and the dX~ kernel against per-kernel references
     computed from the same jnp math as `moe_ffn_backward`, and the whole `moe_backward`
     (dX, dS, dW1, dW2) against `moe_ffn_backward` itself. Every kernel call runs right after
     a NaN-filled buffer of its outputs' size is freed, so unwritten elements show up;
  2. times with CUPTI (GPU kernel time only) each backward kernel over a small config sweep,
     the whole backward (default configs and the sweep's best, per-plan metadata included),
     the dense batched-matmul bound of the same 12*P*n*d FLOPs (balanced groups, XLA
     einsum), and the XLA backward (`moe_ffn_backward` jitted);
  3. prints a table last and writes results.json and log.txt into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import H100_KIND, other_card_kind, unique_configs
from benchmarks.forward import gpu_time_ms as forward_gpu_time_ms
from benchmarks.forward import sweep as forward_sweep
from benchmarks.logs import open_log

from pallas_moe.kernels import _common
from pallas_moe.kernels.dh import dh_kernel, dh_split, item_cols
from pallas_moe.kernels.dx import dx_rows
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig
from pallas_moe.kernels.moe_backward import BackwardConfig, moe_backward
from pallas_moe.kernels.moe_forward import aggregate_width
from pallas_moe.kernels.weight_grad import (
    PERSISTENT_SMEM_BUDGET, WeightGradConfig, k_block_meta, persistent_smem_bytes, weight_grad,
)
from pallas_moe.nn.functional import router_logits
from pallas_moe.ops.minimal_backward import dswiglu, moe_ffn_backward
from pallas_moe.ops.xla import scan_row_tiles
from pallas_moe.routing.topk import topk_plan

SHAPES = {
    "7b": (24576, 1536, 256, 128, 8),
    "30b": (32768, 4096, 512, 128, 8),
    "7b-n512": (24576, 1536, 512, 64, 4),  # the 7B FLOPs with wider experts
    "7b-n1024": (24576, 1536, 1024, 32, 2),
    "7b-skew": (24576, 1536, 256, 128, 8),  # a quarter of the experts strongly preferred
    "30b-skew": (32768, 4096, 512, 128, 8),
    # Routed as `step.py` routes (a bf16 router layer over the same x), whose groups spread
    # wider than i.i.d. logits give (7B: 1301-1865 rows against 1419-1671): the step's
    # weight gradients run ~1.2x their time here (session 39), is the plan the cause?
    "7b-router": (24576, 1536, 256, 128, 8),
    "30b-router": (32768, 4096, 512, 128, 8),
    "gpt-oss-20b": (8192, 2880, 2880, 32, 4),  # n % 128 != 0: 64-column configs
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),  # issue 15's widths at a training batch
    # Wide experts, where session 61 found the down-proj's default (chosen at n <= 512) wrong;
    # their weight gradients ran at 420-521 TFLOP/s in the steps.
    "30b-n1024": (32768, 4096, 1024, 64, 4),
    "w7168": (8192, 7168, 2048, 16, 2),
    "smoke": (40, 128, 128, 4, 2),
}
ITERS = 20
TOL = 2e-2  # relative Frobenius error, bf16 outputs
SMOKE = False  # set by --smoke: interpret mode, wall-clock timing
ROUNDS = 1  # set by --rounds: sweeps timed round-robin, with paired speed-ups
FLUSH_MB = 0  # set by --flush-l2: every timed call runs after an XLA pass over this many MB


def gpu_time_ms(f, *args, iters=ITERS):
    """`benchmarks.forward.gpu_time_ms` (CUPTI), after `--flush-l2` MB if set; wall-clock
    time of one call in interpret mode (`--smoke`)."""
    if SMOKE:
        jax.block_until_ready(f(*args))  # compile + warm up
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        return (time.perf_counter() - t) * 1e3
    return forward_gpu_time_ms(f, *args, iters=iters, flush_mb=FLUSH_MB)


def poison_then(f, *args, nbytes):
    """Runs f after freeing a NaN-filled buffer of `nbytes`, so fresh outputs start dirty."""
    junk = jnp.full((max(nbytes // 2, 1),), jnp.nan, jnp.bfloat16)
    junk.block_until_ready()
    del junk
    return jax.block_until_ready(f(*args))


def rel_err(got, want, rows=None):
    g = np.asarray(got if rows is None else got[:rows], np.float32)
    w = np.asarray(want if rows is None else want[:rows], np.float32)
    if not np.all(np.isfinite(g)):
        return float("inf")
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def make_case(shape, seed, skew=False, router=False):
    """Fresh (x, w1, w2, plan, grad_out). The plan is top-K over i.i.d. normal logits, or
    (`router`) over `step.py`'s logits: a bf16 router layer `x @ W_r`, W_r ~ N(0, 1/d)."""
    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, d), jnp.float32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
    if router:
        w_router = jax.random.normal(ks[3], (d, E), jnp.float32) * d**-0.5
        logits = jax.jit(lambda a, w: router_logits(a, w, dtype="bfloat16"))(x, w_router)
    else:
        logits = jax.random.normal(ks[3], (T, E), jnp.float32)
    if skew:  # +1.5 on a quarter of the experts: group sizes spread ~20x (as forward.py)
        logits = logits + jnp.where(jnp.arange(E) < E // 4, 1.5, 0.0)
    grad_out = jax.random.normal(ks[4], (T, d), jnp.float32).astype(jnp.bfloat16)
    plan = jax.jit(lambda l: topk_plan(l, K, score="softmax_topk"))(logits)
    return x, w1, w2, plan, grad_out


@jax.jit
def saved_h(x, plan, w1):
    """The forward's residual H = X[tok] @ W1[e] (bf16 [P, 2n], fp32 accumulate), via XLA."""
    cap, two_n = plan.capacity, w1.shape[2]

    def step(h_all, rows, valid, tok, s, e):
        h = jnp.einsum("cmd,cdf->cmf", x[tok], w1[e], preferred_element_type=jnp.float32)
        r = jnp.where(valid, rows, cap).reshape(-1)
        return h_all.at[r].set(h.astype(x.dtype).reshape(-1, two_n), mode="drop")

    return scan_row_tiles(plan, step, jnp.zeros((cap, two_n), x.dtype), block_m=128,
                          tiles_per_step=8)


@jax.jit
def reference_intermediates(h, plan, w1, w2, grad_out):
    """XLA dH [P, 2n], A' [P, n], dS [P] and dX~ [P, d] (the same math as moe_ffn_backward)."""
    cap, n, d = plan.capacity, w2.shape[1], w2.shape[2]
    dtype = h.dtype

    def step(carry, rows, valid, tok, s, e):
        dh_all, ap_all, ds_all, dxr_all = carry
        h_t = h[rows]
        da = jnp.einsum("cmd,cnd->cmn", grad_out[tok], w2[e], preferred_element_type=jnp.float32)
        a = jax.nn.silu(h_t[..., :n].astype(jnp.float32)) * h_t[..., n:].astype(jnp.float32)
        dh = dswiglu(h_t, s[..., None] * da).astype(dtype)
        dxr = jnp.einsum("cmf,cdf->cmd", dh, w1[e], preferred_element_type=jnp.float32)
        r = jnp.where(valid, rows, cap).reshape(-1)
        dh_all = dh_all.at[r].set(dh.reshape(-1, 2 * n), mode="drop")
        ap_all = ap_all.at[r].set((s[..., None] * a).astype(dtype).reshape(-1, n), mode="drop")
        ds_all = ds_all.at[r].set(jnp.sum(da * a, axis=-1).reshape(-1), mode="drop")
        dxr_all = dxr_all.at[r].set(dxr.astype(dtype).reshape(-1, d), mode="drop")
        return dh_all, ap_all, ds_all, dxr_all

    init = (jnp.zeros((cap, 2 * n), dtype), jnp.zeros((cap, n), dtype),
            jnp.zeros((cap,), jnp.float32), jnp.zeros((cap, d), dtype))
    return scan_row_tiles(plan, step, init, block_m=128, tiles_per_step=8)


def pad_rows(a, rows):
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0))) if a.shape[0] < rows else a


def dense_bound_ms(shape):
    """Balanced batched matmuls with the backward's 12*P*n*d FLOPs (m = P / E rows each):
    dA' [E,m,d]x[E,d,n], dW2 [E,n,m]x[E,m,d], dW1 [E,d,m]x[E,m,2n], dX~ [E,m,2n]x[E,2n,d]."""
    T, d, n, E, K = shape
    m = T * K // E
    bmm = jax.jit(lambda a, b: jnp.einsum("emk,ekn->emn", a, b))
    total = 0.0
    for i, (a_shape, b_shape) in enumerate([((E, m, d), (E, d, n)), ((E, n, m), (E, m, d)),
                                            ((E, d, m), (E, m, 2 * n)),
                                            ((E, m, 2 * n), (E, 2 * n, d))]):
        ka, kb = jax.random.split(jax.random.key(100 + i))
        a = jax.random.normal(ka, a_shape, jnp.bfloat16)
        b = jax.random.normal(kb, b_shape, jnp.bfloat16)
        total += gpu_time_ms(bmm, a, b)
        del a, b
    return total


def sweep(name, configs, build, args, check, flops, log):
    """`benchmarks.forward.sweep` on fixed `args`: `build(cfg)` is the function to jit,
    `check(out)` its error; `--rounds` times the configs round-robin."""
    return forward_sweep(name, configs, lambda cfg: (jax.jit(build(cfg)), args),
                         lambda f, a: check(f(*a)), flops, log, ROUNDS, gpu_time_ms, TOL)


def configs_for(d, n, sweep: str):
    """The default configs, plus per kernel: "previous" = the previous versions' settings
    (3 stages); "full" = the block-size sweep of earlier sessions; "registers" = the even
    register split (`rebalance_registers=False`) of the fused dH (where it is the default)
    and both weight gradients; the other sweeps are described where they are built."""
    base = BackwardConfig.for_shape(d, n)
    W = WeightGradConfig
    dh = [base.dh]
    dw2 = [base.dw_down]
    dw1 = [base.dw_gate_up]
    dx = [base.dx]
    if sweep == "previous":
        # Session 3: one more stage (the epilogue reuses the pipeline's SMEM) and, for the
        # weight gradients, expert-major grids; the previous version had neither. (dH's
        # 3 stages with H prefetched into its own SMEM went with `prefetch_h` in session 42.)
        rep = dataclasses.replace
        dh += [rep(base.dh, num_stages=4)]
        for lst, cfg in ((dw2, base.dw_down), (dw1, base.dw_gate_up)):
            lst.append(rep(cfg, num_stages=3))
        # (Session 63 removed tile-major weight-gradient items, `expert_major=False`:
        # measured 1064 / 536 us against expert-major's 652 / 365 for dW1 / dW2 at 7B on the
        # H100 in session 4.)
    # (Session 64 removed the "cluster" sweep with the grouped GEMM's clusters, dX~'s
    # `cluster_m=2`; dH's clusters, 0.90-1.00x on the H100 in session 51, were removed in
    # session 62, the weight gradients' (0.98-1.02x in session 51) in session 63.)
    if sweep == "lag":
        # Session 51: dX~ with every slot released as soon as its own K step's wgmmas are
        # done (`wgmma_lag=0`: one more stage loading; 3 stages instead of 4 cost the 30B
        # up-proj 0.878x, so the held slot may be what starves this loop too); since session
        # 64 lag 0 is the H100's default for 192-column items (gpt-oss), timed here against
        # lag 1. (Session 64 removed dH's and the weight gradients' lag 0: on the H100 at
        # gpt-oss's widths dH 0.994x, dW2 0.989x, dW1 0.995x over 3 rounds;
        # `benchmarks/history/session64/dh_weight_grad_lag0.patch` restores them.)
        dx.append(dataclasses.replace(base.dx, wgmma_lag=1 - base.dx.wgmma_lag))
    if sweep == "registers":
        # The audit list (session 63's, still open after session 64): `rebalance_registers=
        # False` (the even register split, no setmaxnreg: 168 registers per thread with two
        # consumers, 128 with three) was only measured on kernels since removed (noise), never
        # on today's persistent dH and weight gradients; timed here against the defaults so
        # the loser can go. dH's candidate is the fused kernel's (`DHConfig`), so only where
        # the fused kernel is the default (`base.dh_gemm is None`: d < 2048, or 256 not
        # dividing n, e.g. 7B and gpt-oss): where dH is split (d >= 2048 with 256 dividing
        # n, e.g. 30B) the default runs the grouped GEMM (which always moves the registers
        # to its consumers: no such option) and the row pass instead, and the fused
        # `base.dh` timed there is not the default, so no dH candidate is added.
        rep = dataclasses.replace
        if base.dh_gemm is None:
            dh.append(rep(base.dh, rebalance_registers=False))
        dw2.append(rep(base.dw_down, rebalance_registers=False))
        dw1.append(rep(base.dw_gate_up, rebalance_registers=False))
    # (Session 64 removed the "rows" sweep, dX~'s split-M items of 192 rows on three
    # consumers: 1.013x at gpt-oss in session 51, inside the spread.)
    if sweep == "narrow":
        # Session 48: where 128 does not divide n (gpt-oss: n = 2880) dH's default was one
        # consumer of 64 columns (151 TF/s on the H100); three consumers of 64 (now the
        # default where 192 divides n) and one of 192 both measured ~2.05x.
        rep = dataclasses.replace
        for bn, cons in ((192, 1), (64, 3), (64, 1)):  # (64, 1): the default before
            if n % (bn * cons) == 0 and (bn, cons) != (base.dh.block_n, base.dh.num_consumers):
                dh.append(rep(base.dh, block_n=bn, num_consumers=cons))
        # The weight gradients with three consumers where two do not divide the width they
        # split: dW2's consumers split n (one consumer of 64 rows at gpt-oss, 294 TFLOP/s),
        # dW1's split 2n (two of 64 columns there).
        if n % (3 * base.dw_down.block_m) == 0 and base.dw_down.num_consumers != 3:
            dw2.append(rep(base.dw_down, num_consumers=3))
        if (2 * n) % (3 * base.dw_gate_up.block_n) == 0 and base.dw_gate_up.num_consumers != 3:
            dw1.append(rep(base.dw_gate_up, num_consumers=3))
    # (Session 4's "completion" sweep, hardware-tracked cp.async stages against the lagged
    # publish, went in session 64: session 63 removed the weight gradients' lagged publish
    # (dW1 615 / 4164 and dW2 335 / 2086 us against mbarrier's 575 / 3877 and 323 / 1933 at
    # 7B / 30B on the H100, session 4), session 64 dH's mbarrier stages (1.001x / 0.927x on
    # an H200, session 39); `benchmarks/history/session64/dh_mbarrier_completion.patch`.)
    if sweep == "epilogue":
        # Session 6: the dSwiGLU epilogue in column chunks (64 by default) against the
        # previous version's whole block at once (epilogue_cols=0).
        # (128-row tiles measured slower: 1750 / 5423 us at 7B / 30B, RESULTS.md.)
        # Chunks narrower than a 64-column slab needed the untiled tiles, removed in session
        # 42 with session 7's `early_h` sweep (one CTA per tile).
        dh.append(dataclasses.replace(base.dh, epilogue_cols=0))
    if sweep == "approx":
        # Session 8: the dSwiGLU epilogue's exp as ex2.approx (`approx_math`, the default
        # since session 12) against the full-precision exp.
        dh.append(dataclasses.replace(base.dh, approx_math=not base.dh.approx_math))
    if sweep == "pingpong":
        # Session 9: dX~ on the engine's 128-row ping-pong schedule (the default at
        # 2n <= 512) against split-M items (the previous default, 256 columns where d allows).
        bn = 256 if d % 256 == 0 else 128
        dx += [GroupedMatmulConfig(block_m=128, block_n=bn, num_stages=3 if bn > 128 else 4),
               GroupedMatmulConfig(block_m=128, block_n=128, num_stages=5, pingpong=True)]
    if sweep == "slabs":
        # Session 36: dX~ with one (or two) output slabs staged at a time (`out_slabs`) and
        # the stage that frees: the 128-row ping-pong 6 stages instead of 5, split-M
        # 256-column items 4 instead of 3 (the fp8 up-proj gained 1.03x at 30B this way).
        # Since session 37 an H200's ping-pong dX~ is the one slab with 6 stages; the
        # H100's config (the whole tile) is the previous default.
        rep = dataclasses.replace
        whole = BackwardConfig.for_shape(d, n, device_kind=H100_KIND).dx
        more = rep(whole, num_stages=whole.num_stages + 1)
        dx += [whole, rep(whole, out_slabs=1), rep(more, out_slabs=1)]
        if not whole.pingpong and whole.block_n // 64 % 2 == 0:
            dx.append(rep(more, out_slabs=2))
        # (Session 64 removed the ring of staged slabs in the whole tile's SMEM,
        # `out_buffers`: level on both cards.)
        dx = unique_configs(dx)
    if sweep == "cards":
        # Session 43: the other card's defaults on this card (on the H100 the H200's persistent
        # weight gradients, 4 stages beside one output buffer per consumer, and its one-slab
        # dX~; on the H200 the H100's).
        other = BackwardConfig.for_shape(d, n, device_kind=other_card_kind())
        dh, dw2, dw1, dx = (unique_configs(lst + [c]) for lst, c in (
            (dh, other.dh), (dw2, other.dw_down), (dw1, other.dw_gate_up), (dx, other.dx)))
    if sweep == "retune":
        # Session 39, on today's kernels (persistent dH with swizzled slabs, the H200's
        # persistent weight gradients, session 27's precomputed cp.async addresses): dH with
        # one stage fewer; dW2 (0.72 of its dense bound at 7B) with one stage fewer and one
        # CTA per item (5 stages do not fit beside the persistent kernel's output buffer).
        # (dH's hardware-tracked cp.async stages, "mbarrier", with 5 and 4 stages measured
        # 1.001x / 0.927x and 0.925x / 0.925x at 7B / 30B on an H200 here; removed in
        # session 64.)
        rep = dataclasses.replace
        dh += [rep(base.dh, num_stages=base.dh.num_stages - 1)]
        dw2 += [rep(base.dw_down, num_stages=base.dw_down.num_stages - 1),
                rep(base.dw_down, persistent_ctas=0, output_chunks=0)]
        # (Session 63 removed dW2's lagged publish, "wait_group": 0.931x / 0.898x paired at
        # 7B / 30B on the H200 in session 39.)
    if sweep == "persistent":
        # Session 63: other tiles of the persistent weight gradients (the "full" sweep's
        # alternatives below are the one-CTA-per-item kernel of sessions before 44). Each
        # candidate keeps the default's persistent CTAs and loader and is kept only where
        # its stages and output buffers fit in SMEM: wider gathered chunks (192 columns:
        # each contiguous K-block feeds 1.5x the rows), narrower contiguous tiles with one
        # more consumer, every output chunk buffered (3 stages), one stage fewer.
        rep = dataclasses.replace
        for lst, cfg, gathered in ((dw2, base.dw_down, "rhs"), (dw1, base.dw_gate_up, "lhs")):
            if not cfg.persistent_ctas:
                continue
            wide = "block_n" if gathered == "rhs" else "block_m"  # the gathered side's width
            narrow = "block_m" if gathered == "rhs" else "block_n"
            # Session 64 made 192-wide gathered chunks with 3 stages 7B's default; there the
            # previous default (128 wide, 4 stages) is the first alternative.
            other_width = (rep(cfg, **{wide: 128}, num_stages=4) if getattr(cfg, wide) == 192
                           else rep(cfg, **{wide: 192}, num_stages=3))
            candidates = [
                other_width,
                rep(cfg, **{wide: 256}, num_stages=3),
                rep(cfg, **{narrow: 64}, num_consumers=cfg.num_consumers * 2),
                rep(cfg, **{narrow: 64}, **{wide: 256}),
                rep(cfg, num_stages=3, output_chunks=0),
                rep(cfg, num_stages=cfg.num_stages - 1),
            ]
            lst += [c for c in candidates if c != cfg and c.num_stages >= 3
                    and d % getattr(c, wide) == 0
                    and persistent_smem_bytes(c, gathered, 2) <= PERSISTENT_SMEM_BUDGET]
    if sweep == "full":
        dh += [dataclasses.replace(base.dh, block_n=128, num_stages=4, num_consumers=1),
               dataclasses.replace(base.dh, block_n=64, num_stages=4, num_consumers=2)]
        dw2 += [W(block_m=128, block_n=128, num_stages=3, num_consumers=2),
                W(block_m=64, block_n=256 if d % 256 == 0 else 128, num_stages=3,
                  num_consumers=2),
                W(block_m=128, block_n=64, num_stages=4, num_consumers=2),
                W(block_m=128, block_n=128, num_stages=4, num_consumers=1)]
        dw1 += [W(block_m=64, block_n=256, num_stages=2, num_consumers=2),
                W(block_m=128, block_n=128, num_stages=3, num_consumers=2),
                W(block_m=64, block_n=128, num_stages=4, num_consumers=2),
                W(block_m=128, block_n=128, num_stages=4, num_consumers=1)]
        dx += [GroupedMatmulConfig(block_m=128, block_n=128, num_stages=4)]
    ok = lambda c, *dims: all(dim % m == 0 for dim, m in dims)
    cons = lambda c: c.num_consumers
    dh = [c for c in dh if ok(c, (n, item_cols(c)))]
    dw2 = [c for c in dw2 if ok(c, (n, c.block_m * cons(c)), (d, c.block_n))]
    dw1 = [c for c in dw1 if ok(c, (d, c.block_m), (2 * n, c.block_n * cons(c)))]
    dx = [c for i, c in enumerate(dx) if ok(c, (d, c.block_n)) and c not in dx[:i]]
    return base, dh, dw2, dw1, dx


def run_shape(name, shape, log, sweep_kind: str):
    T, d, n, E, K = shape
    x, w1, w2, plan, go = make_case(shape, seed=len(name) * 7 + 1, skew=name.endswith("skew"),
                                   router=name.endswith("router"))
    P = plan.capacity
    rows = int(plan.num_rows)
    gs = np.asarray(plan.group_sizes)
    res = dict(name=name, T=T, d=d, n=n, E=E, K=K, P=P, group_min=int(gs.min()),
               group_max=int(gs.max()))
    log(f"== {name} (T,d,n,E,K)={shape} groups [{gs.min()}, {gs.max()}]")
    flops = 12 * P * n * d
    interp = dict(interpret=True) if SMOKE else {}

    h = jax.block_until_ready(saved_h(x, plan, w1))
    ref = jax.block_until_ready(jax.jit(moe_ffn_backward)(x, h, plan, w1, w2, go))
    r_dh, r_ap, r_ds, r_dxr = jax.block_until_ready(reference_intermediates(h, plan, w1, w2, go))
    base, dh_cfgs, dw2_cfgs, dw1_cfgs, dx_cfgs = configs_for(d, n, sweep_kind)

    # ---- whole backward (default configs) vs moe_ffn_backward, poisoned outputs
    bwd = jax.jit(lambda *a: moe_backward(*a, config=base, **interp))
    got = poison_then(bwd, x, h, plan, w1, w2, go, nbytes=P * (5 * n + d) * 2)
    for key, g, r in zip(("dx", "d_scores", "dw_gate_up", "dw_down"), got, ref):
        res[f"err_bwd_{key}"] = rel_err(g, r)
    res["d_scores_padding_zero"] = bool(not np.any(np.asarray(got[1])[rows:]))
    got2 = bwd(x, h, plan, w1, w2, go)
    res["bwd_bitwise_repeat"] = all(
        bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(got, got2))
    del got, got2
    log("  whole backward vs moe_ffn_backward: " + " ".join(
        f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()
        if k.startswith(("err_bwd", "d_scores_pad", "bwd_bit"))))

    # ---- per kernel: correctness (poisoned) and timing sweeps
    metas = {}

    def dh_meta(bm):
        if ("dh", bm) not in metas:
            metas[("dh", bm)] = jax.jit(lambda g, t: _common.tile_meta(g, t, bm))(
                plan.group_sizes, plan.token_ids)
        return metas[("dh", bm)]

    kmeta = jax.jit(lambda g, t: k_block_meta(g, t, 64))(plan.group_sizes, plan.token_ids)

    def check_dh(out):
        dh, ap, ds = out
        e = max(rel_err(dh, r_dh, rows), rel_err(ap, r_ap, rows), rel_err(ds, r_ds))
        return e

    def build_dh(cfg):
        meta = dh_meta(cfg.tile_rows)
        return lambda go, h, t, g, s, w: dh_kernel(go, h, t, g, s, w, config=cfg, meta=meta,
                                                   **interp)

    dh_args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    poison_then(jax.jit(build_dh(base.dh)), *dh_args, nbytes=P * 3 * n * 2)
    (t_dh, c_dh), res["dh_sweep"] = sweep("dH", dh_cfgs, build_dh, dh_args, check_dh,
                                          2 * P * n * d, log)
    if base.dh_gemm is not None:  # the default splits dH in two (d >= 2048): time that too
        split_meta = jax.jit(lambda g: _common.aligned_tile_meta(g, P, base.dh_gemm.tile_rows))(
            plan.group_sizes)
        split = jax.jit(lambda *a: dh_split(*a, gemm=base.dh_gemm, meta=split_meta,
                                            pad_rows_to=base.dh.pad_rows_to,
                                            approx_math=base.dh.approx_math,
                                            da_dtype=base.dh_da_dtype, **interp))
        res["err_dh_split"] = check_dh(poison_then(split, *dh_args, nbytes=P * 5 * n * 2))
        res["dh_split_us"] = gpu_time_ms(split, *dh_args) * 1e3
        log(f"  dH split (the default: {base.dh_gemm}, dA' {base.dh_da_dtype}): "
            f"{res['dh_split_us']:.1f} us, "
            f"{2 * P * n * d / res['dh_split_us'] / 1e6:.0f} TFLOP/s, err {res['err_dh_split']:.1e}")

    p64 = -(-P // 64) * 64
    ap_in, dh_in = pad_rows(r_ap, p64), pad_rows(r_dh, p64)

    def build_wg(gathered, out_dtype):
        def build(cfg):
            return lambda l, r, t, g: weight_grad(l, r, t, g, gathered=gathered,
                                                  out_dtype=out_dtype, config=cfg, meta=kmeta,
                                                  **interp)
        return build

    dw2_args = (ap_in, go, plan.token_ids, plan.group_sizes)
    poison_then(jax.jit(build_wg("rhs", w2.dtype)(base.dw_down)), *dw2_args, nbytes=E * n * d * 2)
    (t_dw2, c_dw2), res["dw2_sweep"] = sweep(
        "dW2", dw2_cfgs, build_wg("rhs", w2.dtype), dw2_args, lambda o: rel_err(o, ref[3]),
        2 * P * n * d, log)
    dw1_args = (x, dh_in, plan.token_ids, plan.group_sizes)
    poison_then(jax.jit(build_wg("lhs", w1.dtype)(base.dw_gate_up)), *dw1_args,
                nbytes=E * 2 * n * d * 2)
    (t_dw1, c_dw1), res["dw1_sweep"] = sweep(
        "dW1", dw1_cfgs, build_wg("lhs", w1.dtype), dw1_args, lambda o: rel_err(o, ref[2]),
        4 * P * n * d, log)

    width = aggregate_width(d)

    def build_dx(cfg):
        meta = jax.jit(lambda g: _common.aligned_tile_meta(g, P, cfg.tile_rows))(plan.group_sizes)
        return lambda a, g, w: dx_rows(a, g, w, capacity=P, config=cfg, meta=meta,
                                       out_cols=width, **interp)

    dx_args = (dh_in, plan.group_sizes, w1)
    poison_then(jax.jit(build_dx(base.dx)), *dx_args, nbytes=P * width * 2)
    (t_dx, c_dx), res["dx_sweep"] = sweep(
        "dX~", dx_cfgs, build_dx, dx_args, lambda o: rel_err(o[:, :d], r_dxr, rows),
        4 * P * n * d, log)

    # ---- whole backward, timed: defaults and the sweep's best
    res["bwd_default_us"] = gpu_time_ms(bwd, x, h, plan, w1, w2, go) * 1e3
    best = BackwardConfig(dh=c_dh or base.dh, dw_down=c_dw2 or base.dw_down,
                          dw_gate_up=c_dw1 or base.dw_gate_up, dx=c_dx or base.dx,
                          aggregate=base.aggregate)
    bwd_best = jax.jit(lambda *a: moe_backward(*a, config=best, **interp))
    got = bwd_best(x, h, plan, w1, w2, go)
    res["err_bwd_best"] = max(rel_err(g, r) for g, r in zip(got, ref))
    del got
    res["bwd_best_us"] = gpu_time_ms(bwd_best, x, h, plan, w1, w2, go) * 1e3
    res["best_config"] = str(best)
    res.update(dh_us=t_dh * 1e3, dw2_us=t_dw2 * 1e3, dw1_us=t_dw1 * 1e3, dx_us=t_dx * 1e3)
    res["bmm_bound_us"] = dense_bound_ms(shape) * 1e3 if not SMOKE else float("nan")
    try:
        res["xla_bwd_us"] = gpu_time_ms(jax.jit(moe_ffn_backward), x, h, plan, w1, w2, go,
                                        iters=5) * 1e3
    except Exception as e:  # noqa: BLE001
        log(f"  xla backward failed: {type(e).__name__}: {str(e)[:300]}")
        res["xla_bwd_us"] = float("nan")
    bwd_us = min(res["bwd_default_us"], res["bwd_best_us"])
    res["bwd_tflops"] = flops / (bwd_us * 1e-6) / 1e12
    res["bwd_vs_bmm"] = res["bmm_bound_us"] / bwd_us
    res["bwd_speedup_vs_xla"] = res["xla_bwd_us"] / bwd_us
    errs = [v for k, v in res.items() if k.startswith("err")]
    sweeps_ok = all(r.get("err", 0) < TOL for k in ("dh_sweep", "dw2_sweep", "dw1_sweep",
                                                    "dx_sweep") for r in res[k])
    res["correct"] = bool(all(e < TOL for e in errs) and res["d_scores_padding_zero"]
                          and sweeps_ok)
    log("  " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                           for k, v in res.items() if not k.endswith("_sweep")}))
    return res


def table(results):
    head = ("| shape | ok | dH us | dW2 us | dW1 us | dX~ us | bwd us | bwd TF/s | bmm bound us | "
            "bwd/bmm | xla bwd us | speedup vs xla |")
    lines = [head, "|" + "---|" * 12]
    for r in results:
        bwd_us = min(r["bwd_default_us"], r["bwd_best_us"])
        lines.append(
            f"| {r['name']} | {'yes' if r['correct'] else 'NO'} | {r['dh_us']:.0f} | "
            f"{r['dw2_us']:.0f} | {r['dw1_us']:.0f} | {r['dx_us']:.0f} | {bwd_us:.0f} | "
            f"{r['bwd_tflops']:.0f} | {r['bmm_bound_us']:.0f} | {r['bwd_vs_bmm']:.2f} | "
            f"{r['xla_bwd_us']:.0f} | {r['bwd_speedup_vs_xla']:.1f} |")
    return "\n".join(lines)


def main():
    global SMOKE, ROUNDS, FLUSH_MB
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shapes", default="7b,30b")
    ap.add_argument("--smoke", action="store_true", help="CPU interpret mode, tiny shape")
    ap.add_argument("--sweep", default="previous", choices=("none", "previous", "epilogue", "approx", "pingpong", "slabs", "retune", "cards", "narrow", "lag", "registers", "persistent", "full"),
                    help="configs timed besides the defaults, on every shape (\"full\": its block-size "
                         "sweep on the first shape, \"previous\" on the rest; see configs_for)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each sweep's configs round-robin this many rounds (the median, "
                         "and paired speed-ups over the sweep's first config)")
    ap.add_argument("--flush-l2", type=int, default=0, metavar="MB",
                    help="time every call right after an XLA pass over this many MB (e.g. 256; "
                         "the H200's L2 holds 50), counting only the call's own kernels")
    args = ap.parse_args()
    SMOKE = args.smoke
    ROUNDS = args.rounds
    FLUSH_MB = args.flush_l2
    shapes = ["smoke"] if SMOKE else args.shapes.split(",")
    log = open_log(args.out, "log.txt")
    log(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    results = []
    for i, name in enumerate(shapes):
        try:
            results.append(run_shape(name, SHAPES[name], log,
                                     sweep_kind="previous" if args.sweep == "full" and i else args.sweep))
        except Exception:  # noqa: BLE001 - keep the other shapes' numbers
            log(f"{name} failed:\n{traceback.format_exc()}")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    log("\nbest configs: " + "; ".join(f"{r['name']}: {r['best_config']}" for r in results))
    log("\n" + table(results))
    return 0 if results and all(r["correct"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
