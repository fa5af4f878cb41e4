"""Issue 9 probe: would dH split in two beat the fused kernel at 30B?

    dA' = dO[tok] @ W2[e]^T     a grouped GEMM with 128-row items and 128-register
                                accumulators (the up-proj's shape), f32 out, no epilogue
    dH, A', dS = dSwiGLU(H, s * dA')   a memory-bound pass over dA', H

Measured here with what exists (no new kernel): the GEMM as the bf16 grouped GEMM over dO
gathered beforehand (contiguous rows; the gathered bf16 mode does not exist yet), f32 and
bf16 out, a few configs; the dSwiGLU pass as XLA's fusion of the reference formula
(`SwiGLU.grad`); the fused dH kernel (default) and a copy of the pass's bytes in the same
run. Every output is checked against the reference (rel. Frobenius error).
Usage: PYTHONPATH=. python3 benchmarks/history/session60/dh_split_probe.py 30b,7b"""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.backward import SHAPES, gpu_time_ms, make_case, reference_intermediates, rel_err, saved_h
from pallas_moe.kernels import _common
from pallas_moe.kernels.dh import dh_kernel
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.ops.activation import SwiGLU

rows_out = []
for name in (sys.argv[1] if len(sys.argv) > 1 else "30b,7b").split(","):
    shape = SHAPES[name]
    T, d, n, E, K = shape
    x, w1, w2, plan, go = make_case(shape, seed=3)
    P = plan.capacity
    rows = int(plan.num_rows)
    h = jax.block_until_ready(saved_h(x, plan, w1))
    r_dh, r_ap, r_ds, _ = jax.block_until_ready(reference_intermediates(h, plan, w1, w2, go))
    cfg = BackwardConfig.for_shape(d, n)
    meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.dh.tile_rows))(plan.group_sizes, plan.token_ids)
    fused = jax.jit(lambda *a: dh_kernel(*a, config=cfg.dh, meta=meta))
    args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    out = fused(*args)
    err = max(rel_err(out[0], r_dh, rows), rel_err(out[1], r_ap, rows), rel_err(out[2], r_ds))
    t_fused = gpu_time_ms(fused, *args) * 1e3
    print(f"== {name} {shape}: fused dH {t_fused:.1f} us (err {err:.1e})", flush=True)
    rows_out.append((name, "fused dH (default)", t_fused, err))
    del out

    do_g = jax.block_until_ready(jax.jit(lambda g, t: g[t])(go, plan.token_ids))  # [P, d]
    s = plan.scores
    act = SwiGLU()

    def dswiglu(da, h, s):  # f32 [P, n], bf16 [P, 2n], f32 [P]
        a = act(h)  # f32 [P, n]
        ds = jnp.sum(da * a, axis=-1)
        dh = act.grad(h, s[:, None] * da).astype(jnp.bfloat16)
        return dh, (s[:, None] * a).astype(jnp.bfloat16), ds

    ew = jax.jit(dswiglu)
    variants = []
    for bn, stages, cl, slabs in ((256, 3, 1, 1), (256, 3, 1, 2), (128, 4, 1, 0), (128, 4, 2, 0),
                                  (256, 4, 1, 1), (128, 5, 1, 1), (256, 3, 2, 1)):
        if n % bn:
            continue
        variants.append(GroupedMatmulConfig(block_m=128, block_n=bn, num_stages=stages,
                                            cluster_m=cl, out_slabs=slabs))
    da_best = None
    for gcfg in variants:
        label = f"GEMM f32 bn={gcfg.block_n} st={gcfg.num_stages} cl={gcfg.cluster_m} slabs={gcfg.out_slabs}"
        try:
            gmeta = jax.jit(lambda g: _common.aligned_tile_meta(g, P, gcfg.tile_rows))(plan.group_sizes)
            gemm = jax.jit(lambda a, g, w, gcfg=gcfg, gmeta=gmeta: grouped_matmul(
                a, g, w, transpose_w=True, config=gcfg, meta=gmeta, capacity=P,
                out_dtype=jnp.float32))
            da = jax.block_until_ready(gemm(do_g, plan.group_sizes, w2))
            dh2, ap2, ds2 = ew(da, h, s)
            e2 = max(rel_err(dh2, r_dh, rows), rel_err(ap2, r_ap, rows), rel_err(ds2, r_ds, rows))
            t = gpu_time_ms(gemm, do_g, plan.group_sizes, w2) * 1e3
            print(f"  {label}: {t:.1f} us, split dH err {e2:.1e}", flush=True)
            rows_out.append((name, label, t, e2))
            if da_best is None:
                da_best = da
            del dh2, ap2, ds2
        except Exception as e:  # noqa: BLE001
            print(f"  {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if da_best is not None:
        t_ew = gpu_time_ms(ew, da_best, h, s) * 1e3
        nbytes = P * n * 4 + P * 2 * n * 2 + P * 2 * n * 2 + P * n * 2 + P * 8
        print(f"  dSwiGLU pass (XLA): {t_ew:.1f} us for {nbytes / 1e6:.0f} MB "
              f"({nbytes / t_ew / 1e6:.2f} TB/s)", flush=True)
        rows_out.append((name, "dSwiGLU pass (XLA fusion)", t_ew, float("nan")))
        buf = jnp.zeros((nbytes // 4,), jnp.float32)
        cp = jax.jit(lambda b: b + 1.0)
        t_cp = gpu_time_ms(cp, buf) * 1e3
        print(f"  copy of {nbytes / 2e6:.0f} MB each way: {t_cp:.1f} us ({nbytes / t_cp / 1e6:.2f} TB/s)")
        rows_out.append((name, "copy, same bytes", t_cp, float("nan")))
        del buf, da_best
    del do_g, h

print("\n| shape | variant | us | err |\n|---|---|---|---|")
for r in rows_out:
    print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1e} |")
