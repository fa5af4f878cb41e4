"""Diagnose test_fp8_grouped_matmul_on_gpu[*-promoted]: save the kernel's outputs and the
model's, and every check's outcome, without stopping at the first failing assert."""
import functools, os, sys
import numpy as np, jax, jax.numpy as jnp
import pallas_moe as pm
from pallas_moe.kernels.grouped_gemm import grouped_matmul
from tests import test_quant_fp8 as T
out = os.environ.get("OUT", ".")
for gated in (False, True):
    for promote in (1, 0):
        plan, (a, w, rs, cs) = T.gpu_test_operands(gated)
        cfg = pm.quant.Fp8ForwardConfig.for_shape(1536, 256, promote_every=promote)
        config = cfg.up if gated else cfg.down
        f = jax.jit(functools.partial(grouped_matmul, transpose_w=True, config=config, gated=gated))
        got = f(a, plan.group_sizes, w, row_scales=rs, col_scales=cs)
        got2 = f(a, plan.group_sizes, w, row_scales=rs, col_scales=cs)
        rows = int(plan.num_rows)
        g = np.asarray(got[:rows], np.float32)
        sample = T.gpu_test_sample(plan)
        modeled = np.asarray(T.modeled_rows(sample, plan, a, w, rs, cs, gated=gated, promote_blocks=promote), np.float32)
        gs = g[sample]
        eq = np.mean(gs == modeled)
        ulp = np.abs(gs.view(np.int32).astype(np.int64) - modeled.view(np.int32).astype(np.int64)) >> 16
        want = np.asarray(T.fp8_grouped_matmul_reference(a, plan.group_sizes, w, rs, cs, gated=gated), np.float32)[:rows]
        err = T.rel_err(g, want)
        bad = np.argwhere(gs != modeled)
        print(f"gated={gated} promote={promote} config={config}\n  bit_equal={eq:.5f} (min {T.MODEL_BIT_EQUAL_MIN}) "
              f"mismatch={len(bad)} bf16-step diffs max={ulp.max()} hist={np.bincount(np.minimum(ulp.ravel(), 8))} "
              f"rows with mismatches={len(np.unique(bad[:,0])) if len(bad) else 0}/{len(sample)} cols={np.unique(bad[:,1])[:20] if len(bad) else []} "
              f"err_vs_exact={err:.2e} tol={T.FP8_PROMOTED_GEMM_VS_EXACT_TOL[gated]} repeat_bitwise={bool(jnp.array_equal(got, got2))}", flush=True)
        if len(bad):
            print("  first mismatches (row, col, got, model):", [(int(sample[r]), int(c), float(gs[r, c]), float(modeled[r, c])) for r, c in bad[:8]])
        np.savez_compressed(f"{out}/fp8diag_g{int(gated)}_p{promote}.npz", g=gs, modeled=modeled, sample=sample)
        if promote and not gated:
            lo, hi = T.bounded_rows(sample, plan, a, w, rs, cs, gated=False, promote_blocks=promote)
            print("  outside rigorous bound:", int((~((lo <= gs) & (gs <= hi))).sum()))
        if gated:
            lo, hi = T.modeled_h_interval(sample, plan, a, w, rs, cs, promote_blocks=promote)
            print("  outside SwiGLU-of-model-H interval:", int((~((lo <= gs) & (gs <= hi))).sum()))
