"""Issue 9: the split dH (`dh.dh_split`: the gathered grouped GEMM dA' = dO[tok] @ W2^T in
f32, then the dSwiGLU row pass) against the fused dH kernel (`dh_kernel`, the default), same
run, paired rounds. Checks first, on poisoned outputs: dH and A' bitwise the fused kernel's
(real rows), dS within 1e-5 relative, all three against XLA's reference; then times each
GEMM config with the row pass (and each kernel alone for the first config).
Usage: PYTHONPATH=. python3 benchmarks/history/session60/dh_split.py 30b,7b [rounds]"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.backward import (SHAPES, gpu_time_ms, make_case, poison_then,
                                 reference_intermediates, rel_err, saved_h)
from benchmarks.forward import SHAPES as FORWARD_SHAPES
from benchmarks.forward import interleaved_times_ms
from pallas_moe.kernels import _common
from pallas_moe.kernels.dh import dh_kernel, dh_split, dswiglu_rows
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
from pallas_moe.kernels.moe_backward import BackwardConfig

names = (sys.argv[1] if len(sys.argv) > 1 else "30b,7b").split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
table = []
for name in names:
    shape = SHAPES.get(name) or FORWARD_SHAPES[name]  # e.g. w2880, w7168: forward.py's
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
    print(f"== {name} {shape}: fused vs XLA dH {rel_err(ref[0], r_dh, rows):.1e} A' "
          f"{rel_err(ref[1], r_ap, rows):.1e} dS {rel_err(ref[2], r_ds):.1e}", flush=True)
    variants = [("fused (default)", fused)]
    gemms = []
    for bn, st, slabs in ((256, 4, 1), (256, 3, 0), (128, 4, 0), (128, 5, 1)):
        if n % bn:
            continue
        g = GroupedMatmulConfig(block_m=128, block_n=bn, num_stages=st, out_slabs=slabs)
        gmeta = jax.jit(lambda gs: _common.aligned_tile_meta(gs, P, 128))(plan.group_sizes)
        f = jax.jit(lambda *a, g=g, gmeta=gmeta: dh_split(*a, gemm=g, meta=gmeta,
                                                          pad_rows_to=cfg.dh.pad_rows_to))
        label = f"split bn={bn} st={st} slabs={slabs}"
        try:
            got = [np.asarray(o, np.float32)
                   for o in poison_then(f, *args, nbytes=P * (3 * n * 2 + n * 4))]
        except Exception as e:  # noqa: BLE001
            print(f"  {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        same = all(np.array_equal(a[:rows], b[:rows]) for a, b in zip(got[:2], ref[:2]))
        ds_err = rel_err(got[2], ref[2])
        xla = max(rel_err(got[0], r_dh, rows), rel_err(got[1], r_ap, rows), rel_err(got[2], r_ds))
        pad_zero = not np.any(got[2][rows:])
        print(f"  {label}: dH/A' bitwise the fused {same}, dS vs fused {ds_err:.1e}, vs XLA "
              f"{xla:.1e}, dS 0 on padding {pad_zero}", flush=True)
        if same and ds_err < 1e-5 and np.all(np.isfinite(got[0][:rows])):
            variants.append((label, f))
            gemms.append((g, gmeta))
    if gemms:  # each kernel of the first split alone
        g, gmeta = gemms[0]
        gemm = jax.jit(lambda a, t, gs, w: grouped_matmul(
            a, gs, w, transpose_w=True, config=g, meta=gmeta, capacity=P, out_dtype=jnp.float32,
            token_ids=t))
        da = gemm(go, plan.token_ids, plan.group_sizes, w2)
        nr = jnp.sum(plan.group_sizes, dtype=jnp.int32).reshape(1)
        for br in (4, 8, 2):
            rp = jax.jit(lambda a, hh, s, c, br=br: dswiglu_rows(a, hh, s, c, out_rows=P, rows_per_cta=br))
            t = gpu_time_ms(rp, da, h, plan.scores, nr) * 1e3
            nbytes = P * (n * 4 + 2 * n * 2 + 2 * n * 2 + n * 2 + 8)
            print(f"  row pass alone, {br} rows per CTA: {t:.1f} us ({nbytes / t / 1e6:.2f} TB/s)")
            table.append((name, f"row pass, {br} rows/CTA", t, nbytes / t / 1e6))
        t = gpu_time_ms(gemm, go, plan.token_ids, plan.group_sizes, w2) * 1e3
        print(f"  GEMM alone ({g.block_n} cols, {g.num_stages} stages): {t:.1f} us "
              f"({2 * P * n * d / t / 1e6:.0f} TFLOP/s)", flush=True)
        table.append((name, "GEMM alone", t, 2 * P * n * d / t / 1e6))
        del da
    times = interleaved_times_ms([(f, args) for _, f in variants], rounds,
                                 lambda f, *a: gpu_time_ms(f, *a))
    base = times[0][0]
    for (label, _), (t, _, spread) in zip(variants, times):
        table.append((name, label, t * 1e3, base / t))
        print(f"  {label}: {t * 1e3:.1f} us, fused / this {base / t:.3f} (spread {spread:.1%})")
    del h
print("\n| shape | variant | us | ratio (fused/this; TB/s; TFLOP/s) |\n|---|---|---|---|")
for r in table:
    print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.3f} |")
