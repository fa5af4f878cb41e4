"""MoE SmoothQuant kernel: on-device correctness and bandwidth (run on an H100); with
`--fp8`, the fp8 inference path against the bf16 one.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/quant.py --out $OUT [--shapes 7b,30b,d2048,d7168]
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/quant.py --fp8 --out $OUT [--shapes 7b,30b]

`--fp8` (shapes (T, d, n, E, K) of `FP8_SHAPES`, top-K routing over random logits, N(0,1)
X and N(0, 1/fan_in) weights, no smoothing): checks the fp8 forward on poisoned outputs
against its XLA reference (first `REF_TOKENS` tokens) within the GPU test's bound
(`quant.reference.requantization_bound`, from the GEMMs' errors against exact sums measured
in the same run), then times (CUPTI, same process) the fp8 up-proj (gated fp8 grouped GEMM
gathering the per-token quantized rows) against the bf16 up-proj (gather fused, inference:
A only), the X and A quantizations, both down-projs and the whole forwards
(`moe_forward(inference=True)` vs `pm.quant.moe_ffn_fp8`, per-plan metadata included), and
the per-token relative error of the fp8 output against the bf16 kernels' output (mean and
99th percentile).
`--more` adds the other gather completion, the SmoothQuant recipe (per-row X quantization in
grouped order), the quantization passes' rows per CTA and a promotion sweep
(`PROMOTE_SWEEP`). `--up-sweep` / `--down-sweep` time the fp8 up-proj / down-proj at the blocks of
`FP8_SWEEPS` against the default in the same run (each output bitwise the default's on its
rows). Writes fp8_results.json, fp8_log.txt and fp8_RESULTS.md (tables also
printed last).

For each shape (T, d, E, K), routing (top-K over random logits; token rounding on one shape,
so there are padding rows) and output dtype (int8, e4m3), it:
  1. checks `pm.quant.moe_smoothquant(backend="mosaic")` (the CSR kernel,
     `quant.kernel.smoothquant_kernel`) on fresh random data against the XLA reference
     (`backend="xla"`, same formula) on every row, bit for bit, and against an independent
     numpy implementation of the formula on a sample of rows (all padding rows included);
     outputs are produced right after freeing a buffer filled with a byte the formula never
     produces there (int8: 0x80 = -128, e4m3 and the f32 scales: 0xff = NaN), so an
     unwritten row shows up;
  2. times with CUPTI (GPU kernel time), same run: the CSR kernel at each block config of
     `CONFIGS` (the non-default ones first checked bitwise against the op's output, on
     poisoned buffers), the whole op (the CSR kernel and its per-plan metadata), the XLA
     reference, and a device copy (`v + 1` on a [P, d] bf16 array) as the bandwidth
     reference;
  3. reports the bytes the op must move (X read once: T*d*2; Q written: P*d; scales: 4*P;
     smooth scales E*d*4; metadata) over the best CSR config's time, as a fraction of the
     copy's bytes/s (target >= 0.8; `csr/copy`), and writes results.json, quant_log.txt and
     quant_RESULTS.md into --out.
With --interpret (CPU, `--shapes tiny`) only step 1 runs, with the kernel in interpret mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

import ml_dtypes
import numpy as np

import jax
import jax.numpy as jnp

import pallas_moe as pm
from benchmarks.logs import markdown_report, open_log
from benchmarks.forward import gpu_time_ms, interleaved_times_ms
from pallas_moe.quant import SmoothQuantConfig, smoothquant_kernel
from pallas_moe.routing import token_rounding_plan, topk_plan

# (T, d, E, K): the 7B and 30B benchmark shapes, and the other production widths.
SHAPES = {
    "7b": (24576, 1536, 128, 8),
    "30b": (32768, 4096, 128, 8),
    "d2048": (16384, 2048, 64, 8),
    "d7168": (8192, 7168, 256, 8),  # DeepSeek-V3's width, E and K
    "tiny": (40, 256, 4, 2),  # for --interpret
}
CONFIGS = [
    SmoothQuantConfig(),
    SmoothQuantConfig(block_t=2),
    SmoothQuantConfig(block_t=4),
    SmoothQuantConfig(vec=8),  # the default before session 31 where d % 1024 == 0
    SmoothQuantConfig(vec=2),
    SmoothQuantConfig(vec=1),
    SmoothQuantConfig(block_t=2, vec=2),
    SmoothQuantConfig(block_pad=256),
    SmoothQuantConfig(x_per_row=True),  # X widened per row: the default from d = 4096 on
    SmoothQuantConfig(x_per_row=False),  # the f32 row held: the default below d = 4096
    # Smooth-scale rows: into registers in their own row (the default below d = 4096), or
    # 1 / 2 rows in flight to SMEM (2: the default from d = 4096 on; session 54);
    # `benchmarks/history/session54/quant_smem.py` times 1-4 staged rows. (Session 63
    # removed `scale_rows_ahead`, scale rows held in registers 1-3 rows ahead: measured
    # 0.63-0.81x at 2-3 rows (H200, session 26) and 0.96x at 1 row, d = 4096 and 7168
    # (H100, session 54); `history/session63/smoothquant_scale_rows_ahead.patch`.)
    SmoothQuantConfig(scale_rows_smem=0),
    SmoothQuantConfig(scale_rows_smem=1),
    SmoothQuantConfig(scale_rows_smem=2),
    # Staged rows with X per row below d = 4096 (7B: 9 CTAs per SM by registers, 56 a
    # thread; if the two together free 8, a tenth fits). Not yet measured.
    SmoothQuantConfig(scale_rows_smem=2, x_per_row=True),
]
POISON = {jnp.dtype(jnp.int8): 0x80, jnp.dtype(jnp.float8_e4m3fn): 0xFF}
NUMPY_SAMPLE_ROWS = 2048


def same_kernel_key(cfg: SmoothQuantConfig, d: int) -> SmoothQuantConfig:
    """`cfg` with the choices its None fields make at width `d` filled in (X per row,
    staged scale rows), so two entries of `CONFIGS` that run the same kernel compare equal."""
    return dataclasses.replace(cfg, x_per_row=cfg.resolve_x_per_row(d),
                               scale_rows_smem=cfg.resolve_scale_rows_smem(d))


def poison_then(f, *args, nbytes, byte):
    """Runs f right after freeing a buffer of `nbytes` filled with `byte`."""
    junk = jnp.full((nbytes,), byte, jnp.uint8)
    junk.block_until_ready()
    del junk
    return jax.block_until_ready(f(*args))


def numpy_rows(x, smooth, tokens, experts, out_dtype):
    """The formula in numpy f32 (independent of the library), for the given rows."""
    qmax = np.float32(127.0 if out_dtype == jnp.int8 else 448.0)
    y = x[tokens].astype(np.float32) * smooth[experts]
    s = np.max(np.abs(y), axis=1) * (np.float32(1) / qmax)
    s[s < np.finfo(np.float32).tiny] = 0
    with np.errstate(divide="ignore"):
        inv = np.where(s > 0, np.float32(1) / s, np.float32(0)).astype(np.float32)
    v = np.clip(y * inv[:, None], -qmax, qmax)
    q = np.rint(v).astype(np.int8) if out_dtype == jnp.int8 else v.astype(ml_dtypes.float8_e4m3fn)
    return q, s


def mismatches(got_q, got_s, want_q, want_s):
    """(Q elements that differ bitwise, scales that differ bitwise)."""
    gq = np.asarray(got_q).view(np.uint8)
    wq = np.asarray(want_q).view(np.uint8)
    gs = np.asarray(got_s, np.float32).view(np.uint32)
    ws = np.asarray(want_s, np.float32).view(np.uint32)
    return int(np.sum(gq != wq)), int(np.sum(gs != ws))


def make_case(shape, routing, seed):
    T, d, E, K = shape
    ks = jax.random.split(jax.random.key(seed), 4)
    mag = 10.0 ** jax.random.uniform(ks[0], (T, 1), jnp.float32, -2, 2)  # rows over 4 decades
    x = (mag * jax.random.normal(ks[1], (T, d), jnp.float32)).astype(jnp.bfloat16)
    x = x.at[0].set(0)  # a zero row
    smooth = jax.random.uniform(ks[2], (E, d), jnp.float32, 0.1, 4.0)
    logits = jax.random.normal(ks[3], (T, E), jnp.float32)
    if routing == "topk":
        plan = jax.jit(lambda l: topk_plan(l, K))(logits)
    else:
        plan = jax.jit(lambda l: token_rounding_plan(l, K, tile=128, rounding="nearest"))(logits)
    return x, smooth, plan


def kernel_args(plan):
    """The kernel's per-plan metadata, computed once (what `moe_smoothquant` does inside)."""
    row_experts = jnp.minimum(plan.expert_ids[plan.rows_by_token], plan.num_experts - 1)
    return plan.token_row_offsets, plan.rows_by_token, row_experts, plan.num_rows


def run_case(name, shape, routing, out_dtype, log, interpret=False):
    T, d, E, K = shape
    out_dtype = jnp.dtype(out_dtype)
    x, smooth, plan = make_case(shape, routing, seed=hash((name, routing)) % 1000)
    P, rows = plan.capacity, int(plan.num_rows)
    res = dict(name=name, routing=routing, out_dtype=out_dtype.name, T=T, d=d, E=E, K=K, P=P,
               rows=rows)
    log(f"== {name} {routing} {out_dtype.name} (T,d,E,K)={shape} P={P} real rows={rows}")

    # ---- correctness: every row vs XLA (bitwise), a sample vs numpy, padding rows zero
    backend = "interpret" if interpret else "mosaic"
    op = jax.jit(lambda x, s, p: pm.quant.moe_smoothquant(x, s, p, out_dtype=out_dtype, backend=backend))
    ref = jax.jit(lambda x, s, p: pm.quant.moe_smoothquant(x, s, p, out_dtype=out_dtype, backend="xla"))
    nbytes = P * d + 4 * P
    q, s = poison_then(op, x, smooth, plan, nbytes=nbytes, byte=POISON[out_dtype])
    q_ref, s_ref = jax.block_until_ready(ref(x, smooth, plan))
    res["mismatch_q_vs_xla"], res["mismatch_s_vs_xla"] = mismatches(q, s, q_ref, s_ref)
    rng = np.random.default_rng(0)
    sample = np.unique(np.concatenate([rng.integers(0, rows, NUMPY_SAMPLE_ROWS), [0, rows - 1]]))
    tok = np.asarray(plan.token_ids)[sample]
    exp = np.asarray(plan.expert_ids)[sample]
    want_q, want_s = numpy_rows(np.asarray(x, np.float32), np.asarray(smooth), tok, exp, out_dtype)
    q_np, s_np = np.asarray(q), np.asarray(s)
    res["mismatch_q_vs_numpy"], res["mismatch_s_vs_numpy"] = mismatches(
        q_np[sample], s_np[sample], want_q, want_s)
    res["padding_rows_zero"] = bool(
        np.all(q_np[rows:].view(np.uint8) == 0) and np.all(s_np[rows:] == 0))
    res["no_poison_left"] = bool(
        np.all(np.isfinite(s_np)) and np.all(s_np >= 0)
        and (out_dtype != jnp.int8 or not np.any(q_np == -128))
        and (out_dtype == jnp.int8 or np.all(np.isfinite(q_np.astype(np.float32)))))
    res["correct"] = bool(
        res["mismatch_q_vs_xla"] == 0 and res["mismatch_s_vs_xla"] == 0
        and res["mismatch_q_vs_numpy"] == 0 and res["mismatch_s_vs_numpy"] == 0
        and res["padding_rows_zero"] and res["no_poison_left"])
    log("  checks: " + " ".join(f"{k}={res[k]}" for k in res if k.startswith(("mismatch", "padding", "no_poison"))))
    del q_ref, s_ref
    if interpret:
        log("  interpret mode: correctness checks only, no timings")
        return res

    # ---- timings: the CSR kernel's configs, the op, XLA, a device copy
    meta = jax.jit(kernel_args)(plan)
    best = (float("inf"), None)
    timed = {}  # config with this width's defaults filled in -> the CONFIGS entry timed as it
    for cfg in CONFIGS:
        run = same_kernel_key(cfg, d)
        if run in timed:  # e.g. x_per_row=True from d = 4096 on is the default's kernel
            log(f"  csr {cfg}: at d={d} the kernel of {timed[run]}, not timed again")
            continue
        timed[run] = cfg
        f = jax.jit(lambda x, s, off, r, e, n, cfg=cfg: smoothquant_kernel(
            x, s, off, r, e, n, num_out_rows=P, out_dtype=out_dtype, config=cfg))
        try:
            if cfg != CONFIGS[0]:  # the default was checked against the op above
                qc, sc = poison_then(f, x, smooth, *meta, nbytes=nbytes, byte=POISON[out_dtype])
                bad = mismatches(qc, sc, q, s)
                if bad != (0, 0):
                    log(f"  csr {cfg}: WRONG ({bad[0]} Q, {bad[1]} s mismatches), not timed")
                    continue
            t = gpu_time_ms(f, x, smooth, *meta)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
            log(f"  csr {cfg}: failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        log(f"  csr {cfg}: {t * 1e3:.1f} us")
        if cfg == CONFIGS[0]:
            res["default_us"] = t * 1e3
        if t < best[0]:
            best = (t, cfg)
    res["csr_us"] = best[0] * 1e3
    res["csr_cfg"] = str(best[1])
    res["op_us"] = gpu_time_ms(op, x, smooth, plan) * 1e3  # with the per-plan metadata
    res["xla_us"] = gpu_time_ms(ref, x, smooth, plan, iters=5) * 1e3
    moved = T * d * 2 + P * d * out_dtype.itemsize + 4 * P + E * d * 4 + 4 * (T + 1) + 8 * P + 4
    res["bytes_moved"] = moved
    copy_src = jax.random.normal(jax.random.key(3), (P, d), jnp.bfloat16)
    t_copy = gpu_time_ms(jax.jit(lambda v: v + 1), copy_src)
    res["copy_us"] = t_copy * 1e3
    res["copy_GBs"] = 2 * P * d * 2 / (t_copy * 1e-3) / 1e9
    res["csr_vs_copy"] = moved / (res["csr_us"] * 1e-6) / 1e9 / res["copy_GBs"]
    # The op's kernel: the CSR kernel at the op's default config (CONFIGS[0]); `csr_*` is
    # the best of CONFIGS, which the op runs only when it is the default.
    res["kernel_us"] = res.get("default_us", float("nan"))
    res["kernel_GBs"] = moved / (res["kernel_us"] * 1e-6) / 1e9
    res["kernel_vs_copy"] = res["kernel_GBs"] / res["copy_GBs"]
    log("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}))
    log(f"  RATIOS {name} {routing} {out_dtype.name}: csr/copy {res['csr_vs_copy']:.2f} "
        f"(best csr {res['csr_us']:.1f} us, default {res['kernel_us']:.1f} us = "
        f"{res['kernel_vs_copy']:.2f} of copy; copy of P*d bf16 {t_copy * 1e3:.1f} us)")
    return res


TABLE_COLS = [
    ("shape", lambda r: f"{r['name']} {r['routing']}"),
    ("out", lambda r: r["out_dtype"].replace("float8_", "")),
    ("P", lambda r: str(r["P"])),
    ("ok", lambda r: "yes" if r["correct"] else "NO"),
    ("CSR us (default config)", lambda r: f"{r['kernel_us']:.1f}"),
    ("CSR us (best config)", lambda r: f"{r['csr_us']:.1f}"),
    ("copy us", lambda r: f"{r['copy_us']:.1f}"),
    ("op us (with metadata)", lambda r: f"{r['op_us']:.0f}"),
    ("MB moved", lambda r: f"{r['bytes_moved'] / 1e6:.0f}"),
    ("copy GB/s", lambda r: f"{r['copy_GBs']:.0f}"),
    ("default/copy", lambda r: f"**{r['kernel_vs_copy']:.2f}**"),
    ("best/copy", lambda r: f"{r['csr_vs_copy']:.2f}"),
    ("xla us", lambda r: f"{r['xla_us']:.0f}"),
]


def markdown(results, cmd, device):
    def failed_row(r):
        if "error" in r:
            status = f"failed: {r['error']}"
        else:
            status = f"{r['P']} | {'yes' if r.get('correct') else 'NO'} | (no timings)"
        return f"| {r.get('name')} {r.get('routing')} | {r.get('out_dtype')} | {status} |"

    lines = markdown_report(
        f"MoE SmoothQuant kernel on {device}", "GPU kernel time (CUPTI), median of 20 calls.",
        cmd,
        "`default/copy` = (bytes the op must move: X once, Q, s, scales / the op's CSR "
        "kernel time, default config) / (a device copy's bytes/s), target >= 0.8; `best/copy` "
        "the same for the fastest of the script's configs (`best config`). `op us` = `moe_smoothquant(backend='mosaic')` "
        "(the CSR kernel and its per-plan metadata). `ok` = bitwise equal to the XLA "
        "reference on every row and to numpy on a sample, padding rows zero, no poison left.",
        TABLE_COLS, results, failed_row,
    )
    lines.append("")
    lines.append("Best CSR configs: " + "; ".join(
        f"{r['name']} {r['routing']} {r['out_dtype']}: {r['csr_cfg']}"
        for r in results if "csr_cfg" in r))
    return "\n".join(lines) + "\n"


# ---- --fp8: the fp8 inference path against the bf16 one

# (T, d, n, E, K): the 7B and 30B benchmark shapes.
FP8_SHAPES = {
    "7b": (24576, 1536, 256, 128, 8),
    "30b": (32768, 4096, 512, 128, 8),
    # Wide experts (session 61: where the bf16 down-proj left the ping-pong).
    "30b-n1024": (32768, 4096, 1024, 64, 4),
    "qwen3": (16384, 2048, 768, 128, 8),
    "tiny": (40, 256, 128, 4, 2),  # for --interpret
}


# Tokens whose outputs are checked against the XLA reference of the fp8 steps. XLA:GPU runs
# the reference's ragged_dot as E zero-padded GEMMs (E = 128 times the FLOPs, in f32): 512
# tokens cost ~2 minutes of the 30B run, 64 tokens (512 rows) a few seconds.
REF_TOKENS = 64
# The GEMM errors feeding the bound (`requantization_bound`): the first GEMM_CHECK_ROWS rows
# of GEMM_CHECK_EXPERTS experts spread over E, against exact f32 sums (dense dots).
GEMM_CHECK_EXPERTS = 8
GEMM_CHECK_ROWS = 256
# fp8_promote_every values the benchmark compares with --more (0 = never; docs/quant.md).
PROMOTE_SWEEP = (0, 1, 2, 4)
# SmoothQuant configs timed for both quantization passes of the fp8 forward (--more).
QUANT_SWEEP = (SmoothQuantConfig(), SmoothQuantConfig(block_t=4), SmoothQuantConfig(block_t=16))
# fp8 GEMM blocks timed against `Fp8ForwardConfig.for_shape`'s with --up-sweep / --down-sweep
# (overrides of its `up` or `down` config).
# up: 128 columns, 4 stages, one output slab staged at a time; the whole tile fits only beside
# 3 stages, the default until session 36. Session 36 also timed 64 columns at 4-6 stages
# (0.88-0.90x: A's rows re-gathered per column block) and gather="tma" (0.70x) at 30B.
# down: 30B (n >= 512) the 128-row ping-pong with 5 stages of 32 KB beside 2 x 32 KB of
# output tiles, 7B split M with 3 stages of 48 KB beside 2 x 32 KB. One staged slab per
# consumer (16 / 8 KB) frees a 6th / 4th stage, as it freed the up-proj's 4th.
# Session 37 made the 30B down-proj's one slab the default (1.011-1.012x; the 6th stage
# 0.99x). (Session 64 removed the ring of two staged slabs, `out_buffers=2`: level on both
# cards.)
FP8_SWEEPS = {
    "up": (dict(num_stages=3, out_slabs=0), dict(num_stages=3, out_slabs=1)),
    "down": (dict(out_slabs=0), dict(out_slabs=1), dict(out_slabs=1, stages_plus=1),
             # Session 61: split-M items 256 columns wide, the bf16 down-proj's default from
             # n = 768 on (1.05-1.25x the ping-pong there); the fp8 ping-pong runs from
             # n = 512 on (session 9: 1.14x the split-M items at 30B). Session 62 (H100):
             # 0.870x at (32768, 4096, 1024, 64, 4) and 0.897x at the Qwen3 widths, so the
             # fp8 default stays.
             dict(pingpong=False, block_n=256, num_stages=3, out_slabs=0)),
}


def gemm_rel_err(out, a, src_rows, row_scales, w, col_scales, group_sizes, *, gated):
    """Norm-wise relative error of a fp8 grouped GEMM's output against exact f32 sums (the
    `fp8_epilogue_reference` of dense f32 dots) on the first GEMM_CHECK_ROWS rows of
    GEMM_CHECK_EXPERTS experts.

    Args:
      out: bf16 [P, N] the kernel's output, grouped rows.
      a: e4m3 [S, K] the rows it multiplied; grouped row r is `a[src_rows[r]]` with scale
        `row_scales[src_rows[r]]`.
      src_rows: i32 [P]. w: e4m3 [E, N (2N gated), K]. col_scales: f32 [E, N (2N)].
      group_sizes: i32 [E].
    """
    from pallas_moe.kernels.reference import fp8_epilogue_reference

    num_experts = w.shape[0]
    experts = np.linspace(0, num_experts - 1, GEMM_CHECK_EXPERTS).astype(int)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)[:-1]])
    window = jnp.arange(GEMM_CHECK_ROWS, dtype=jnp.int32)

    def per_expert(e):
        rows = jnp.minimum(starts[e] + window, out.shape[0] - 1)
        valid = (window < group_sizes[e])[:, None]
        src = src_rows[rows]
        acc = jnp.dot(a[src].astype(jnp.float32), w[e].astype(jnp.float32).T,
                      precision=jax.lax.Precision.HIGHEST)
        cols = jnp.broadcast_to(col_scales[e], acc.shape)
        ref = fp8_epilogue_reference(acc, row_scales[src], cols, gated=gated).astype(jnp.float32)
        got = out[rows, :ref.shape[1]].astype(jnp.float32)
        return (jnp.sum(jnp.where(valid, (got - ref) ** 2, 0.0)),
                jnp.sum(jnp.where(valid, ref ** 2, 0.0)))

    sq = jax.jit(lambda: [per_expert(int(e)) for e in experts])()
    return float(np.sqrt(sum(float(d) for d, _ in sq) / sum(float(r) for _, r in sq)))


def gathered_up8(config, capacity, interpret=False):
    """The gated fp8 up-proj gathering the per-token quantized rows, jitted:
    f(q, group_sizes, w, row_scales, col_scales, meta, token_ids) -> A [P, n]."""
    from pallas_moe.kernels.grouped_gemm import grouped_matmul

    return jax.jit(lambda q, g, w, s, c, m, t: grouped_matmul(
        q, g, w, transpose_w=True, config=config, meta=m, capacity=capacity, row_scales=s,
        col_scales=c, gated=True, token_ids=t, interpret=interpret))


def down8(config, capacity, interpret=False):
    """The fp8 down-proj on A's re-quantized grouped rows, jitted:
    f(q, group_sizes, w, row_scales, col_scales) -> Y [P, d] bf16."""
    from pallas_moe.kernels.grouped_gemm import grouped_matmul

    return jax.jit(lambda q, g, w, s, c: grouped_matmul(
        q, g, w, transpose_w=True, config=config, capacity=capacity, row_scales=s,
        col_scales=c, interpret=interpret))


def run_fp8_case(name, shape, log, interpret=False, more=False, sweeps=(), rounds=1):
    from benchmarks.forward import poison_then as poison_nan_then
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.down_proj import down_proj
    from pallas_moe.kernels.moe_forward import ForwardConfig, moe_forward
    from pallas_moe.kernels.up_proj import up_proj
    from pallas_moe.quant import Fp8ForwardConfig, quantize_tokens_kernel
    from pallas_moe.quant.reference import (
        BF16_OUTPUT_ROUNDING, FP8_VS_BF16_TOL, requantization_bound,
    )

    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(hash(name) % 1000), 4)
    x = jax.random.normal(ks[0], (T, d), jnp.float32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[3], (T, E), jnp.float32)
    plan = jax.jit(lambda l: topk_plan(l, K))(logits)
    experts = jax.block_until_ready(jax.jit(pm.quant.quantize_experts)(w1, w2))  # no smoothing
    ones_up, ones_down = jnp.ones((E, d), jnp.float32), jnp.ones((E, n), jnp.float32)
    P = plan.capacity
    res = dict(name=name, T=T, d=d, n=n, E=E, K=K, P=P)
    log(f"== fp8 {name} (T,d,n,E,K)={shape} P={P}")
    num_sms = 4 if interpret else None
    base = ForwardConfig.for_shape(d, n, num_sms=num_sms)
    cfg = Fp8ForwardConfig.for_shape(d, n, num_sms=num_sms)
    backend = "interpret" if interpret else "mosaic"
    timed = gpu_time_ms if not interpret else (
        lambda f, *a: (jax.block_until_ready(f(*a)), float("nan"))[1])
    kw = dict(interpret=interpret)

    # ---- correctness: poisoned outputs, against the XLA reference of the same steps
    fp8_fwd = jax.jit(lambda x, p, e: pm.quant.moe_ffn_fp8(x, p, e, backend=backend, config=cfg))
    bf16_fwd = jax.jit(lambda x, p, w1, w2: moe_forward(
        x, p, w1, w2, config=base, inference=True, interpret=interpret)[0])
    out8 = poison_nan_then(fp8_fwd, x, plan, experts, nbytes=P * (3 * n + 2 * d) * 2)
    out16 = bf16_fwd(x, plan, w1, w2)
    o8, o16 = np.asarray(out8, np.float64), np.asarray(out16, np.float64)
    res["finite"] = bool(np.all(np.isfinite(o8)))
    per_token = np.linalg.norm(o8 - o16, axis=1) / np.maximum(np.linalg.norm(o16, axis=1), 1e-30)
    res["rel_err_mean"] = float(np.mean(per_token))
    res["rel_err_p99"] = float(np.percentile(per_token, 99))
    res["rel_err_all"] = float(np.linalg.norm(o8 - o16) / np.linalg.norm(o16))
    # The XLA reference on the first REF_TOKENS tokens only (see REF_TOKENS). Top-K routes
    # each token by its own logits and every fp8 step is per row (aggregation: per token), so
    # these tokens' outputs are the same as in the whole batch.
    ref_tokens = min(T, REF_TOKENS)
    ref_fwd = jax.jit(lambda x, l, e: pm.quant.moe_ffn_fp8(x, topk_plan(l, K), e, backend="xla"))
    ref = np.asarray(ref_fwd(x[:ref_tokens], logits[:ref_tokens], experts), np.float64)

    def vs_ref(out):
        return float(np.linalg.norm(np.asarray(out[:ref_tokens], np.float64) - ref)
                     / np.linalg.norm(ref))

    res["vs_xla_ref"] = vs_ref(out8)
    again = np.asarray(fp8_fwd(x, plan, experts))
    res["bitwise_repeat"] = bool(np.array_equal(again.view(np.uint16), np.asarray(out8).view(np.uint16)))
    # The kernels one by one (also timed below): X per token, the gathered up-proj, A's pass,
    # the down-proj; the GEMMs' errors against exact sums on their own inputs give the bound
    # the GPU test uses (`requantization_bound`: A's requantization to e4m3 amplifies the fp8
    # wgmma's truncated sums, tests/fp8_wgmma_model.py).
    qt = jax.jit(lambda x: quantize_tokens_kernel(x, config=cfg.quant, **kw))
    qxt, sxt = qt(x)
    fp8_meta = jax.jit(lambda g: _common.aligned_tile_meta(g, P, cfg.up.block_m))(plan.group_sizes)
    up8 = gathered_up8(cfg.up, P, **kw)
    up8_args = (qxt, plan.group_sizes, experts.w_gate_up, sxt, experts.gate_up_scales, fp8_meta,
                plan.token_ids)
    a8 = up8(*up8_args)
    down_rows = -(-P // cfg.down.block_m) * cfg.down.block_m
    rows = jnp.arange(P + 1, dtype=jnp.int32)
    qa_args = (jnp.minimum(rows, plan.num_rows), rows[:-1],
               jnp.minimum(plan.expert_ids, E - 1), plan.num_rows)
    # A's re-quantization as the forward runs it (`requantize_rows`: the row-block kernel;
    # None: no scale loads), and the previous version (the CSR SmoothQuant kernel, one entry
    # per row, 16 rows per CTA), which must give the same bits.
    from pallas_moe.quant.ffn import requantize_rows

    qa = jax.jit(lambda a, s, p: requantize_rows(a, s, p, num_out_rows=down_rows,
                                                 config=cfg.requant, **kw))
    qa_csr = jax.jit(lambda a, s, off, r, e, nr: smoothquant_kernel(
        a, s, off, r, e, nr, num_out_rows=down_rows, out_dtype=jnp.float8_e4m3fn,
        config=SmoothQuantConfig(block_t=16), **kw))
    q2, s2 = poison_nan_then(qa, a8, experts.smooth_down, plan, nbytes=down_rows * n * 3)
    q2_csr, s2_csr = qa_csr(a8, experts.smooth_down, *qa_args)
    res["requant_equals_csr"] = bool(
        np.array_equal(np.asarray(q2).view(np.uint8), np.asarray(q2_csr).view(np.uint8))
        and np.array_equal(np.asarray(s2).view(np.uint32), np.asarray(s2_csr).view(np.uint32)))
    # With smooth scales (the recipe with S2; the bits must match too).
    smooth_rand = jax.random.uniform(jax.random.key(7), (E, n), jnp.float32, 0.25, 4.0)
    q2s, s2s = poison_nan_then(qa, a8, smooth_rand, plan, nbytes=down_rows * n * 3)
    q2s_csr, s2s_csr = qa_csr(a8, smooth_rand, *qa_args)
    res["requant_smoothed_equals_csr"] = bool(
        np.array_equal(np.asarray(q2s).view(np.uint8), np.asarray(q2s_csr).view(np.uint8))
        and np.array_equal(np.asarray(s2s).view(np.uint32), np.asarray(s2s_csr).view(np.uint32)))
    del q2s, s2s, q2s_csr, s2s_csr, q2_csr, s2_csr
    dn8 = down8(cfg.down, P, **kw)
    dn8_args = (q2, plan.group_sizes, experts.w_down, s2, experts.down_scales)
    y8 = dn8(*dn8_args)
    res["eps_a"] = gemm_rel_err(a8, qxt, plan.token_ids, sxt, experts.w_gate_up,
                                experts.gate_up_scales, plan.group_sizes, gated=True)
    res["eps_y"] = gemm_rel_err(y8, q2, jnp.arange(P, dtype=jnp.int32), s2, experts.w_down,
                                experts.down_scales, plan.group_sizes, gated=False)
    res["vs_xla_bound"] = requantization_bound(res["eps_a"], res["eps_y"] + BF16_OUTPUT_ROUNDING)
    res["correct"] = bool(res["finite"] and res["vs_xla_ref"] < res["vs_xla_bound"]
                          and res["rel_err_all"] < FP8_VS_BF16_TOL and res["bitwise_repeat"]
                          and res["requant_equals_csr"] and res["requant_smoothed_equals_csr"])
    log("  checks: " + json.dumps({k: res[k] for k in res if k.startswith(
        ("finite", "rel_err", "vs_xla", "eps_", "bitwise", "requant_", "correct"))}))

    # ---- timings: each kernel alone on the same inputs, then the whole forwards
    # (--interpret: each kernel runs once in interpret mode; times are NaN)
    up_meta = jax.jit(lambda g, t: _common.tile_meta(g, t, base.up.tile_rows))(plan.group_sizes, plan.token_ids)
    up16 = jax.jit(lambda x, t, g, w, m: up_proj(x, t, g, w, config=base.up, inference=True, meta=m, **kw)[1])
    res["bf16_up_us"] = timed(up16, x, plan.token_ids, plan.group_sizes, w1, up_meta) * 1e3
    res["quant_x_us"] = timed(qt, x) * 1e3
    res["fp8_up_us"] = timed(up8, *up8_args) * 1e3
    # (Session 63 removed the fused re-quantization (`fuse_requant`), measured 0.86-0.89x in
    # sessions 6 and 10; history/session63/fp8_fused_requant.patch restores it.)
    res["up_speedup"] = res["bf16_up_us"] / res["fp8_up_us"]
    res["up_speedup_with_quant"] = res["bf16_up_us"] / (res["fp8_up_us"] + res["quant_x_us"])
    flops_up = 2 * P * d * 2 * n
    res["fp8_up_TFs"] = flops_up / (res["fp8_up_us"] * 1e-6) / 1e12
    res["bf16_up_TFs"] = flops_up / (res["bf16_up_us"] * 1e-6) / 1e12
    # Down-projs: bf16 on the bf16 A, fp8 on A quantized (its quantization timed apart).
    a16 = up16(x, plan.token_ids, plan.group_sizes, w1, up_meta)
    dn16 = jax.jit(lambda a, g, w: down_proj(a, g, w, config=base.down, capacity=P, **kw))
    res["bf16_down_us"] = timed(dn16, a16, plan.group_sizes, w2) * 1e3
    res["quant_a_us"] = timed(qa, a8, experts.smooth_down, plan) * 1e3
    res["quant_a_csr_us"] = timed(qa_csr, a8, experts.smooth_down, *qa_args) * 1e3
    res["quant_a_smoothed_us"] = timed(qa, a8, smooth_rand, plan) * 1e3
    res["quant_a_smoothed_csr_us"] = timed(qa_csr, a8, smooth_rand, *qa_args) * 1e3
    res["fp8_down_us"] = timed(dn8, *dn8_args) * 1e3
    res["bf16_fwd_us"] = timed(bf16_fwd, x, plan, w1, w2) * 1e3
    res["fp8_fwd_us"] = timed(fp8_fwd, x, plan, experts) * 1e3
    res["fwd_speedup"] = res["bf16_fwd_us"] / res["fp8_fwd_us"]
    if rounds > 1:  # the issue's ratio with the card's drift paired out (--rounds)
        (bf16_t, _, bf16_spread), (fp8_t, paired, fp8_spread) = interleaved_times_ms(
            [(bf16_fwd, (x, plan, w1, w2)), (fp8_fwd, (x, plan, experts))], rounds, timed)
        res.update(fwd_rounds=rounds, bf16_fwd_rounds_us=bf16_t * 1e3, fp8_fwd_rounds_us=fp8_t * 1e3,
                   fwd_speedup_paired=paired, bf16_fwd_spread=bf16_spread,
                   fp8_fwd_spread=fp8_spread)
    # What the fp8 forward spends outside its four timed kernels (aggregation, plan metadata).
    res["fp8_fwd_rest_us"] = res["fp8_fwd_us"] - (
        res["quant_x_us"] + res["fp8_up_us"] + res["quant_a_us"] + res["fp8_down_us"])
    log("  " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))
    if more:
        run_fp8_more(res, log, locals())
    for which in sweeps:
        run_fp8_gemm_sweep(res, log, locals(), which)
    return res


def run_fp8_gemm_sweep(res, log, case, which):
    """--up-sweep / --down-sweep: one fp8 GEMM of the forward (`which`: "up", the gated
    up-proj gathering the per-token rows; "down", the down-proj on A's re-quantized rows) at
    each override of `FP8_SWEEPS[which]` on the default blocks, timed beside the default
    (with --rounds, round-robin with paired speed-ups; otherwise the default is timed first
    and last: the same-run spread), each output compared bit for bit with the default's on
    the plan's rows (poisoned buffers)."""
    from benchmarks.forward import poison_then as poison_nan_then

    cfg, kw, timed, P = case["cfg"], case["kw"], case["timed"], case["P"]
    num_rows = int(case["plan"].num_rows)
    if which == "up":
        default, args, want, width = cfg.up, case["up8_args"], case["a8"], case["n"]

        def build(config):
            return gathered_up8(config, P, **kw)
    else:
        default, args, want, width = cfg.down, case["dn8_args"], case["y8"], case["d"]

        def build(config):
            return down8(config, P, **kw)
    want = np.asarray(want[:num_rows]).view(np.uint16)

    rounds = case["rounds"]
    rows, calls = [dict(config="default")], [build(default)]
    if rounds <= 1:  # the default timed first and last: the same-run spread
        rows[0]["us"] = timed(calls[0], *args) * 1e3
    for over in FP8_SWEEPS[which]:
        row = dict(config=",".join(f"{k}={v}" for k, v in over.items()))
        over = dict(over)  # stages_plus: that many stages more than the default's
        over["num_stages"] = over.get("num_stages", default.num_stages) + over.pop("stages_plus", 0)
        if dataclasses.replace(default, **over) == default:
            continue  # the default itself at this shape
        try:
            f = build(dataclasses.replace(default, **over))
            got = poison_nan_then(f, *args, nbytes=P * width * 2)
            row["bitwise_default"] = bool(np.array_equal(
                np.asarray(got[:num_rows]).view(np.uint16), want))
            if rounds <= 1:
                row["us"] = timed(f, *args) * 1e3
            calls.append(f)
        except Exception as e:  # noqa: BLE001 - report and go on (e.g. SMEM overflow)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        log(f"  {which} sweep " + json.dumps(row))
    if rounds > 1:  # round-robin: paired speed-ups over the default in each round
        timed_rows = [r for r in rows if "error" not in r]  # one per call, in order
        for row, (t, paired, spread) in zip(
                timed_rows, interleaved_times_ms([(f, args) for f in calls], rounds, timed)):
            row.update(us=t * 1e3, speedup_vs_default=paired, spread=spread)
    else:
        rows.append(dict(config="default (again)", us=timed(calls[0], *args) * 1e3))
        base = min(rows[0]["us"], rows[-1]["us"])
        for row in rows:
            if "us" in row:
                row["speedup_vs_default"] = base / row["us"]
    for row in rows:
        if "us" in row:
            row["bf16_over_this"] = res[f"bf16_{which}_us"] / row["us"]
    res[f"{which}_sweep"] = rows
    log(f"  {which} sweep: " + json.dumps(rows))


def run_fp8_more(res, log, case):
    """--more: the other gather completion, the SmoothQuant recipe (per-row X quantization
    in grouped order, all-ones scales, the GEMM on contiguous rows), the quantization passes'
    rows per CTA and the promotion sweep (both GEMMs and the whole forward at each
    `fp8_promote_every`, each at its `Fp8ForwardConfig.for_shape` blocks)."""
    from pallas_moe.kernels.grouped_gemm import grouped_matmul
    from pallas_moe.quant import Fp8ForwardConfig

    c = dict(case)
    x, plan, experts, cfg, kw, timed = (c[k] for k in ("x", "plan", "experts", "cfg", "kw", "timed"))
    P, d, n, up8_args = c["P"], c["d"], c["n"], c["up8_args"]
    ones_up, ones_down, qa_args, a8 = c["ones_up"], c["ones_down"], c["qa_args"], c["a8"]
    down_rows, backend, num_sms, vs_ref = c["down_rows"], c["backend"], c["num_sms"], c["vs_ref"]
    o16, fp8_meta, q2, s2 = c["o16"], c["fp8_meta"], c["q2"], c["s2"]
    up8_lagged = gathered_up8(dataclasses.replace(cfg.up, gather_completion="wait_group"), P, **kw)
    res["fp8_up_wait_group_us"] = timed(up8_lagged, *up8_args) * 1e3
    up_rows = -(-P // cfg.up.block_m) * cfg.up.block_m
    qx = jax.jit(lambda x, s, off, r, e, nr: smoothquant_kernel(
        x, s, off, r, e, nr, num_out_rows=up_rows, out_dtype=jnp.float8_e4m3fn, config=cfg.quant, **kw))
    meta_args = jax.jit(kernel_args)(plan)
    q1, s1 = qx(x, ones_up, *meta_args)
    res["quant_x_rows_us"] = timed(qx, x, ones_up, *meta_args) * 1e3
    up8_rows = jax.jit(lambda q, g, w, s, cc, m: grouped_matmul(
        q, g, w, transpose_w=True, config=cfg.up, meta=m, capacity=P, row_scales=s,
        col_scales=cc, gated=True, **kw))
    res["fp8_up_rows_us"] = timed(up8_rows, q1, plan.group_sizes, experts.w_gate_up, s1,
                                  experts.gate_up_scales, fp8_meta) * 1e3
    experts_rows = dataclasses.replace(experts, smooth_up=ones_up, smooth_down=ones_down)
    res["fp8_fwd_rows_us"] = timed(c["fp8_fwd"], x, plan, experts_rows) * 1e3
    res["quant_sweep"] = {}
    for qc in QUANT_SWEEP:
        qa_c = jax.jit(lambda a, s, off, r, e, nr, qc=qc: smoothquant_kernel(
            a, s, off, r, e, nr, num_out_rows=down_rows, out_dtype=jnp.float8_e4m3fn,
            config=qc, **kw))
        qx_c = jax.jit(lambda x, s, off, r, e, nr, qc=qc: smoothquant_kernel(
            x, s, off, r, e, nr, num_out_rows=up_rows, out_dtype=jnp.float8_e4m3fn,
            config=qc, **kw))
        try:
            res["quant_sweep"][f"block_t={qc.block_t}"] = dict(
                a_us=timed(qa_c, a8, ones_down, *qa_args) * 1e3,
                x_us=timed(qx_c, x, ones_up, *meta_args) * 1e3)
        except Exception as e:  # noqa: BLE001 - report and go on
            log(f"  quant block_t={qc.block_t}: FAILED {type(e).__name__}: {str(e)[:300]}")
    log("  more (us): " + json.dumps({k: res[k] for k in (
        "fp8_up_wait_group_us", "quant_x_rows_us", "fp8_up_rows_us", "fp8_fwd_rows_us",
        "quant_sweep")}))
    res["sweep"] = []
    for every in PROMOTE_SWEEP:
        pc = Fp8ForwardConfig.for_shape(d, n, num_sms=num_sms, promote_every=every)
        row = dict(promote_every=every, up_block_n=pc.up.block_n, down_block_n=pc.down.block_n)
        try:
            up = gathered_up8(pc.up, P, **kw)
            dn = jax.jit(lambda q, g, w, s, cc, pc=pc: grouped_matmul(
                q, g, w, transpose_w=True, config=pc.down, capacity=P, row_scales=s,
                col_scales=cc, **kw))
            fwd = jax.jit(lambda x, p, e, pc=pc: pm.quant.moe_ffn_fp8(
                x, p, e, backend=backend, config=pc))
            row["up_us"] = timed(up, *up8_args) * 1e3
            row["down_us"] = timed(dn, q2, plan.group_sizes, experts.w_down, s2,
                                   experts.down_scales) * 1e3
            row["fwd_us"] = timed(fwd, x, plan, experts) * 1e3
            row["fwd_speedup"] = res["bf16_fwd_us"] / row["fwd_us"]
            out = np.asarray(fwd(x, plan, experts), np.float64)
            row["vs_xla_ref"] = vs_ref(out)
            row["rel_err_all"] = float(np.linalg.norm(out - o16) / np.linalg.norm(o16))
            log("  sweep " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                         for k, v in row.items()}))
            res["sweep"].append(row)
        except Exception as e:  # noqa: BLE001 - report and go on with the other intervals
            log(f"  sweep promote_every={every}: FAILED {type(e).__name__}: {str(e)[:300]}")
            log(traceback.format_exc()[-2000:])


FP8_TABLE_COLS = [
    ("shape (T,d,n,E,K)", lambda r: f"{r['name']} ({r['T']},{r['d']},{r['n']},{r['E']},{r['K']})"),
    ("ok", lambda r: "yes" if r["correct"] else "NO"),
    ("bf16 up us", lambda r: f"{r['bf16_up_us']:.0f}"),
    ("fp8 up us", lambda r: f"{r['fp8_up_us']:.0f}"),
    ("up speedup (>= 1.6)", lambda r: f"**{r['up_speedup']:.2f}**"),
    ("X quant us", lambda r: f"{r['quant_x_us']:.0f}"),
    ("up speedup incl. X quant", lambda r: f"{r['up_speedup_with_quant']:.2f}"),
    ("fp8 up TF/s", lambda r: f"{r['fp8_up_TFs']:.0f}"),
    ("bf16 down us", lambda r: f"{r['bf16_down_us']:.0f}"),
    ("A quant us", lambda r: f"{r['quant_a_us']:.0f}"),
    ("A quant CSR (previous) us", lambda r: f"{r['quant_a_csr_us']:.1f}"),
    ("A quant smoothed / CSR us", lambda r: f"{r['quant_a_smoothed_us']:.1f} / {r['quant_a_smoothed_csr_us']:.1f}"),
    ("fp8 down us", lambda r: f"{r['fp8_down_us']:.0f}"),
    ("bf16 fwd us", lambda r: f"{r['bf16_fwd_us']:.0f}"),
    ("fp8 fwd us", lambda r: f"{r['fp8_fwd_us']:.0f}"),
    ("fwd speedup (>= 1.5)", lambda r: f"**{r['fwd_speedup']:.2f}**"),
    ("paired fwd speedup (rounds, spread bf16 / fp8)", lambda r: (
        f"**{r['fwd_speedup_paired']:.3f}** ({r['fwd_rounds']}, {r['bf16_fwd_spread']:.1%} / "
        f"{r['fp8_fwd_spread']:.1%})" if "fwd_speedup_paired" in r else "-")),
    ("fwd rest us", lambda r: f"{r['fp8_fwd_rest_us']:.0f}"),
    ("rel err mean", lambda r: f"{r['rel_err_mean']:.4f}"),
    ("rel err p99", lambda r: f"{r['rel_err_p99']:.4f}"),
    ("vs fp8 XLA ref (bound)", lambda r: f"{r['vs_xla_ref']:.4f} ({r['vs_xla_bound']:.4f})"),
    ("GEMM err A / Y", lambda r: f"{r['eps_a']:.1e} / {r['eps_y']:.1e}"),
]


def fp8_markdown(results, cmd, device):
    def failed_row(r):
        status = f"failed: {r['error']}" if "error" in r else (
            f"{'yes' if r.get('correct') else 'NO'} | (no timings) rel err mean "
            f"{r.get('rel_err_mean', float('nan')):.4f} p99 {r.get('rel_err_p99', float('nan')):.4f}")
        return f"| {r.get('name')} | {status} |"

    lines = markdown_report(
        f"fp8 inference path vs bf16 on {device}",
        "GPU kernel time (CUPTI), median of 20 calls, one process.", cmd,
        "`up` = the up-proj alone: bf16 gathers X rows itself; fp8 gathers the rows of X "
        "quantized once per token (`X quant`, T rows); `A quant` = A's re-quantization (the "
        "row-block pass). `fwd` = the whole inference forward incl. "
        "per-plan metadata. `rel err` = per-token |O_fp8 - O_bf16| / |O_bf16| against the bf16 "
        "kernels (mean, 99th percentile); `vs fp8 XLA ref` = relative error against the jnp "
        f"reference of the same fp8 steps (exact f32 sums) on the first {REF_TOKENS} tokens, "
        "and its bound (`quant.reference.requantization_bound`, the GPU test's: from the GEMMs' "
        "errors against exact sums on their own inputs, `GEMM err A / Y`, amplified by A's "
        "requantization to e4m3). `ok` = finite on poisoned outputs, within the bound, within "
        "FP8_VS_BF16_TOL = 0.1 of bf16, bitwise repeatable, and A's re-quantization bitwise "
        "the CSR kernel's (`requant_equals_csr`, with and without smooth scales).",
        FP8_TABLE_COLS, results, failed_row,
    )
    sweeps = [(r, w) for r in results for w in r.get("sweep", [])]
    lines += [] if not sweeps else [
        "",
        "Promotion sweep (`fp8_promote_every`: K blocks of 128 between the f32 adds of the "
        "tensor cores' partial sums; 0 = never; blocks from `Fp8ForwardConfig.for_shape`). "
        "`vs ref` = relative error of the output against the XLA fp8 steps (exact sums) on "
        f"the first {REF_TOKENS} tokens; `vs bf16` on all. Run with --more.",
        "",
        "| shape | promote every | up / down block_n | fp8 up us | fp8 down us | fp8 fwd us "
        "| fwd speedup | vs ref | vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['name']} | {w['promote_every'] or 'never'} | {w['up_block_n']} / "
        f"{w['down_block_n']} | {w['up_us']:.0f} | {w['down_us']:.0f} | "
        f"{w['fwd_us']:.0f} | {w['fwd_speedup']:.2f} | {w['vs_xla_ref']:.4f} | "
        f"{w['rel_err_all']:.4f} |" for r, w in sweeps]
    quant_rows = [(r["name"], k, v) for r in results for k, v in r.get("quant_sweep", {}).items()]
    if quant_rows:
        lines += ["", "SmoothQuant rows per CTA, us (X: the per-row recipe; the table's `A quant` uses block_t=16):", "",
                  "| shape | config | X quant us | A quant us |", "|---|---|---|---|"]
        lines += [f"| {name} | {k} | {v['x_us']:.0f} | {v['a_us']:.0f} |" for name, k, v in quant_rows]
    for which, name in (("up", "up-proj"), ("down", "down-proj")):
        rows = [(r, w) for r in results for w in r.get(f"{which}_sweep", [])]
        if not rows:
            continue
        lines += ["", f"fp8 {name} blocks (--{which}-sweep; overrides of `Fp8ForwardConfig.for_shape`'s "
                  f"`{which}`; with --rounds, timed round-robin and the ratios paired with the "
                  "default in each round; otherwise the default timed first and last, ratios "
                  "against the faster of the two; "
                  "`bitwise` = output equal to the default's on the plan's rows):", "",
                  f"| shape | config | us | vs default | bf16 {which} / this | bitwise |",
                  "|---|---|---|---|---|---|"]
        lines += [
            f"| {r['name']} | {w['config']} | " + (
                f"{w['us']:.0f} | {w['speedup_vs_default']:.3f} | {w['bf16_over_this']:.3f} | "
                f"{w.get('bitwise_default', '')} |" if "us" in w else f"failed: {w['error']} | | | |")
            for r, w in rows]
    return "\n".join(lines) + "\n"


def main_fp8(args):
    log = open_log(args.out, "fp8_log.txt")
    device = jax.devices()[0].device_kind
    results = []
    shapes = args.shapes if args.shapes != "7b,30b,d2048,d7168" else "7b,30b"
    for name in shapes.split(","):
        try:
            results.append(run_fp8_case(name, FP8_SHAPES[name], log, interpret=args.interpret,
                                        more=args.more,
                                        sweeps=[w for w in ("up", "down") if getattr(args, f"{w}_sweep")],
                                        rounds=args.rounds))
        except Exception as e:  # noqa: BLE001 - report and go on
            log(f"fp8 {name}: FAILED {type(e).__name__}: {e}")
            log(traceback.format_exc()[-3000:])
            results.append(dict(name=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
        with open(os.path.join(args.out, "fp8_results.json"), "w") as f:
            json.dump(dict(device=device, results=results), f, indent=1)
    cmd = "PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/quant.py " + " ".join(sys.argv[1:])
    md = fp8_markdown(results, cmd, device)
    with open(os.path.join(args.out, "fp8_RESULTS.md"), "w") as f:
        f.write(md)
    log(md)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default="7b,30b,d2048,d7168")
    p.add_argument("--fp8", action="store_true",
                   help="the fp8 inference path vs bf16 (shapes 7b,30b by default)")
    p.add_argument("--token-rounding", default="30b", help="shapes also run with token rounding")
    p.add_argument("--dtypes", default="int8,float8_e4m3fn")
    p.add_argument("--more", action="store_true",
                   help="--fp8: also the other gather completion, the per-row SmoothQuant "
                        "recipe, the quantization passes' rows per CTA and the promotion sweep")
    p.add_argument("--up-sweep", action="store_true", dest="up_sweep",
                   help="--fp8: also the fp8 up-proj at the blocks of FP8_SWEEPS['up']")
    p.add_argument("--down-sweep", action="store_true", dest="down_sweep",
                   help="--fp8: also the fp8 down-proj at the blocks of FP8_SWEEPS['down']")
    p.add_argument("--rounds", type=int, default=1,
                   help="--fp8: also time the bf16 and fp8 forwards round-robin this many "
                        "rounds (the paired speed-up, `fwd_speedup_paired`)")
    p.add_argument("--interpret", action="store_true",
                   help="CPU smoke test of this script: kernels in interpret mode, no timings "
                        "(use with --shapes tiny)")
    args = p.parse_args()
    if args.fp8:
        return main_fp8(args)
    log = open_log(args.out, "quant_log.txt")
    device = jax.devices()[0].device_kind
    results = []
    tr = set(s for s in args.token_rounding.split(",") if s)
    for name in args.shapes.split(","):
        for routing in ["topk", "token_rounding"] if name in tr else ["topk"]:
            for dt in args.dtypes.split(","):
                try:
                    results.append(run_case(name, SHAPES[name], routing, jnp.dtype(dt), log,
                                            interpret=args.interpret))
                except Exception as e:  # noqa: BLE001 - report and go on
                    log(f"{name} {routing} {dt}: FAILED {type(e).__name__}: {e}")
                    log(traceback.format_exc()[-3000:])
                    results.append(dict(name=name, routing=routing, out_dtype=dt,
                                        error=f"{type(e).__name__}: {str(e)[:200]}"))
                with open(os.path.join(args.out, "results.json"), "w") as f:
                    json.dump(dict(device=device, results=results), f, indent=1)
    cmd = "PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/quant.py " + " ".join(sys.argv[1:])
    md = markdown(results, cmd, device)
    with open(os.path.join(args.out, "quant_RESULTS.md"), "w") as f:
        f.write(md)
    log(md)


if __name__ == "__main__":
    main()
