"""Session 13: A's re-quantization (issue 13), the row-block kernel against the CSR
SmoothQuant kernel (the previous version) and a device copy, same run, H100.

    PYTHONPATH=. python3 benchmarks/history/session13/requant_ab.py [7b,30b]

For each shape: A bf16 [P, n] with the plan's padding rows NaN (never to be read), the
plan's groups; the CSR kernel's Q and s are the reference, and every row-block variant must
equal them bit for bit on outputs produced right after a poisoned buffer was freed, with and
without smooth scales. Then GPU time (CUPTI) of each, bytes it must move (P n 2 + P n + 4 P)
over time against a same-run device copy's bytes/s.
"""
import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms, poison_then
from pallas_moe.quant.kernel import (
    RowBlockQuantConfig, SmoothQuantConfig, quantize_row_blocks, smoothquant_kernel,
)
from pallas_moe.routing import topk_plan

SHAPES = {"7b": (24576, 256, 128, 8), "30b": (32768, 512, 128, 8)}  # T, n, E, K
E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def variants(n):
    out = {"rb default": RowBlockQuantConfig()}
    for bc in (128, 256, 512):
        if n % bc == 0:
            for st in (1, 2, 3, 4):
                per = 64 * n * 3 + 256
                if st * per <= 220 * 1024:
                    out[f"rb bc{bc} st{st}"] = RowBlockQuantConfig(block_cols=bc, num_stages=st)
    per = 64 * n * 3 + 256
    for st in (1, 2):  # two CTAs per SM
        if 2 * st * per <= 220 * 1024:
            out[f"rb 264ctas st{st}"] = RowBlockQuantConfig(num_stages=st, num_sms=264)
    return out


def main(names):
    rows_out = []
    for name in names:
        T, n, E, K = SHAPES[name]
        logits = jax.random.normal(jax.random.key(1), (T, E), jnp.float32)
        plan = jax.jit(lambda l: topk_plan(l, K))(logits)
        P = plan.capacity
        nr = int(plan.num_rows)
        a = jax.random.normal(jax.random.key(2), (P, n), jnp.float32) * 3
        a = jnp.where(jnp.arange(P)[:, None] < nr, a, jnp.nan).astype(jnp.bfloat16)
        smooth = jax.random.uniform(jax.random.key(3), (E, n), jnp.float32, 0.25, 4.0)
        out_rows = -(-P // 128) * 128
        rows = jnp.arange(P + 1, dtype=jnp.int32)
        csr_args = (jnp.minimum(rows, plan.num_rows), rows[:-1],
                    jnp.minimum(plan.expert_ids, E - 1), plan.num_rows)
        csr = jax.jit(lambda a, s, off, r, e, nrr: smoothquant_kernel(
            a, s, off, r, e, nrr, num_out_rows=out_rows, out_dtype=E4M3,
            config=SmoothQuantConfig(block_t=16)))
        copy_src = jax.random.normal(jax.random.key(4), (P, n), jnp.bfloat16)
        t_copy = gpu_time_ms(jax.jit(lambda v: v + 1), copy_src)
        copy_gbs = 2 * P * n * 2 / (t_copy * 1e-3) / 1e9
        moved = P * n * 2 + out_rows * n + 4 * out_rows
        print(f"== {name} P={P} rows={nr} n={n}: copy {t_copy*1e3:.1f} us ({copy_gbs:.0f} GB/s); "
              f"must move {moved/1e6:.0f} MB", flush=True)
        for smoothed in (False, True):
            s_arg = smooth if smoothed else None
            want_q, want_s = csr(a, s_arg, *csr_args)
            want_q = np.asarray(want_q).view(np.uint8)
            want_s = np.asarray(want_s).view(np.uint32)
            t_csr = gpu_time_ms(csr, a, s_arg, *csr_args)
            base = dict(shape=name, smoothed=smoothed, variant="csr (previous)", us=t_csr * 1e3,
                        vs_copy=moved / (t_csr * 1e-3) / 1e9 / copy_gbs, equal=True)
            rows_out.append(base)
            print("  " + json.dumps(base), flush=True)
            for label, cfg in variants(n).items():
                f = jax.jit(lambda a, s, g, nrr, cfg=cfg: quantize_row_blocks(
                    a, s, g, nrr, num_out_rows=out_rows, out_dtype=E4M3, config=cfg))
                args = (a, s_arg, plan.group_sizes, plan.num_rows)
                try:
                    q, s = poison_then(f, *args, nbytes=out_rows * n * 2)
                    equal = bool(np.array_equal(np.asarray(q).view(np.uint8), want_q)
                                 and np.array_equal(np.asarray(s).view(np.uint32), want_s))
                    t = gpu_time_ms(f, *args) if equal else float("nan")
                except Exception as e:  # noqa: BLE001 - a variant that does not fit
                    print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                row = dict(shape=name, smoothed=smoothed, variant=label, us=t * 1e3,
                           vs_copy=moved / (t * 1e-3) / 1e9 / copy_gbs,
                           vs_csr=t_csr / t, equal=equal)
                rows_out.append(row)
                print("  " + json.dumps(row), flush=True)
    print("\n| shape | smoothed | variant | equal to CSR | us | of copy | speed-up vs CSR |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['shape']} | {r['smoothed']} | {r['variant']} | {r['equal']} | {r['us']:.1f} | "
              f"{r['vs_copy']:.2f} | {r.get('vs_csr', 1.0):.2f} |")


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(","))
