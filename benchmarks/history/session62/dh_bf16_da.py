"""Issue 9: the split dH with dA' in bf16 (`dh_split(da_dtype=bfloat16)`, i.e.
`BackwardConfig.dh_da_dtype="bfloat16"`) against the split with dA' in f32 (the default at
d >= 4096) and the fused dH kernel (the default below), same run, paired rounds.

Why: session 60's split pays for writing dA' in f32 and reading it back (P x n x 8 bytes);
it won at 30B (1.150x) and lost at d = 2048 (0.979x) and 7B (0.866x). In bf16 that round
trip halves. By counting, the row pass moves P x 12n bytes instead of P x 14n (Qwen3 widths
462 -> ~396 us, 7B 233 -> ~200, 30B 616 -> ~528 at 3.05 TB/s), and the GEMM writes half as
much (mostly hidden behind its K loop). Prediction: the bf16 split 1.03-1.07x the fused
kernel at Qwen3's widths, still slower than it at 7B (0.92-0.96x), 1.03-1.06x the f32 split
at 30B. Refuted where it is no faster than the shape's default.

Checks first, on poisoned outputs: the f32 split bitwise the fused kernel (dH, A'); the
bf16 split's A' bitwise the fused kernel's and its dH within 1e-2 of it; all against XLA.
Usage: PYTHONPATH=. python3 benchmarks/history/session62/dh_bf16_da.py 30b,qwen3-30b-a3b,7b [rounds]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.backward import (SHAPES, gpu_time_ms, make_case, poison_then,
                                 reference_intermediates, rel_err, saved_h)
from benchmarks.forward import SHAPES as FORWARD_SHAPES
from benchmarks.forward import interleaved_times_ms
from pallas_moe.kernels import _common
from pallas_moe.kernels.dh import dh_kernel, dh_split
from pallas_moe.kernels.moe_backward import BackwardConfig, dh_split_gemm_config

names = (sys.argv[1] if len(sys.argv) > 1 else "30b,qwen3-30b-a3b,7b").split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
table = []
for name in names:
    shape = SHAPES.get(name) or FORWARD_SHAPES[name]
    T, d, n, E, K = shape
    x, w1, w2, plan, go = make_case(shape, seed=11)
    P = plan.capacity
    rows = int(plan.num_rows)
    h = jax.block_until_ready(saved_h(x, plan, w1))
    r_dh, r_ap, r_ds, _ = jax.block_until_ready(reference_intermediates(h, plan, w1, w2, go))
    cfg = BackwardConfig.for_shape(d, n)
    args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.dh.tile_rows))(plan.group_sizes,
                                                                          plan.token_ids)
    fused = jax.jit(lambda *a: dh_kernel(*a, config=cfg.dh, meta=meta))
    ref = [np.asarray(o, np.float32) for o in poison_then(fused, *args, nbytes=P * 3 * n * 2)]
    default = "split f32" if cfg.dh_gemm is not None else "fused"
    print(f"== {name} {shape} (default: {default}): fused vs XLA dH "
          f"{rel_err(ref[0], r_dh, rows):.1e} A' {rel_err(ref[1], r_ap, rows):.1e} "
          f"dS {rel_err(ref[2], r_ds):.1e}", flush=True)
    gemm = cfg.dh_gemm or dh_split_gemm_config(cfg.dh.persistent_ctas)
    gmeta = jax.jit(lambda gs: _common.aligned_tile_meta(gs, P, gemm.tile_rows))(plan.group_sizes)
    variants = [("fused", fused)]
    for label, dtype in (("split f32", jnp.float32), ("split bf16", jnp.bfloat16)):
        f = jax.jit(lambda *a, dtype=dtype: dh_split(
            *a, gemm=gemm, meta=gmeta, pad_rows_to=cfg.dh.pad_rows_to, da_dtype=dtype))
        got = [np.asarray(o, np.float32)
               for o in poison_then(f, *args, nbytes=P * (3 * n * 2 + n * 4))]
        same_a = np.array_equal(got[1][:rows], ref[1][:rows])
        dh_vs_fused = rel_err(got[0], ref[0], rows)
        xla = max(rel_err(got[0], r_dh, rows), rel_err(got[1], r_ap, rows), rel_err(got[2], r_ds))
        ok = (same_a and np.all(np.isfinite(got[0][:rows])) and not np.any(got[2][rows:])
              and (dh_vs_fused == 0 if dtype == jnp.float32 else dh_vs_fused < 1e-2))
        print(f"  {label}: A' bitwise the fused {same_a}, dH vs fused {dh_vs_fused:.1e}, "
              f"dS vs fused {rel_err(got[2], ref[2]):.1e}, vs XLA {xla:.1e}, ok {ok}", flush=True)
        if ok:
            variants.append((label, f))
        table.append((name, f"{label} vs XLA", xla, dh_vs_fused))
    times = interleaved_times_ms([(f, args) for _, f in variants], rounds,
                                 lambda f, *a: gpu_time_ms(f, *a))
    base = times[0][0]
    for (label, _), (t, _, spread) in zip(variants, times):
        table.append((name, label, t * 1e3, base / t))
        print(f"  {label}: {t * 1e3:.1f} us, fused / this {base / t:.3f} (spread {spread:.1%})",
              flush=True)
    del h
print("\n| shape | variant | us (or error vs XLA) | fused / this (or dH vs fused) |\n|---|---|---|---|")
for r in table:
    print(f"| {r[0]} | {r[1]} | {r[2]:.4g} | {r[3]:.3f} |")
