"""Session 14: MoE-SmoothQuant's grouped rows, the gathered row-block kernel
(`quant.gathered.quantize_gathered_rows`) against the CSR kernel (the previous version) and
a device copy, same run, H100.

    PYTHONPATH=. python3 benchmarks/history/session14/gathered_ab.py [7b,30b] [variant,...]

For each shape (top-K over random logits, smooth scales U(0.1, 4)): the CSR kernel's Q and
s are the reference; every gathered variant must equal them bit for bit on outputs produced
right after a poisoned buffer was freed. GPU time by CUPTI; bytes the op must move (X read
once: T d 2, Q: P d, s: 4 P) over time against a same-run device copy's bytes/s.
"""
import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms, poison_then
from pallas_moe.quant.gathered import GatheredQuantConfig, quantize_gathered_rows
from pallas_moe.quant.kernel import SmoothQuantConfig, smoothquant_kernel
from pallas_moe.routing import topk_plan

SHAPES = {"7b": (24576, 1536, 128, 8), "30b": (32768, 4096, 128, 8),
          "d2048": (16384, 2048, 64, 8), "d7168": (8192, 7168, 256, 8)}
E4M3 = jnp.dtype(jnp.float8_e4m3fn)

VARIANTS = {
    "default": {},
    "p1": dict(parts=1, num_slots=12),
    "p2": dict(parts=2),
    "p2k7": dict(parts=2, num_slots=7),
    "p4": dict(parts=4),
    "p8": dict(parts=8),
    "tma": dict(loader="tma"),
    "grouped_order": dict(token_order=False),
    "p4_2cta": dict(parts=4, num_slots=4, num_sms=264, warpgroups=1),  # two CTAs per SM
    "wg1": dict(warpgroups=1),
    "wg3": dict(warpgroups=3),
    "wg4": dict(warpgroups=4),
    "p4wg2": dict(parts=4, warpgroups=2),
    "no_smoothing": dict(),  # smooth_scales=None, against the CSR kernel without them
}


def main(names, variant_names):
    rows_out = []
    for name in names:
        T, d, E, K = SHAPES[name]
        ks = jax.random.split(jax.random.key(0), 4)
        plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E), jnp.float32))
        mag = 10.0 ** jax.random.uniform(ks[1], (T, 1), jnp.float32, -2, 2)
        x = (mag * jax.random.normal(ks[2], (T, d), jnp.float32)).astype(jnp.bfloat16)
        smooth = jax.random.uniform(ks[3], (E, d), jnp.float32, 0.1, 4.0)
        P = plan.capacity
        row_experts = jnp.minimum(plan.expert_ids[plan.rows_by_token], E - 1)
        csr_args = (plan.token_row_offsets, plan.rows_by_token, row_experts, plan.num_rows)
        csr = jax.jit(lambda x, s, off, r, e, n: smoothquant_kernel(
            x, s, off, r, e, n, num_out_rows=P, out_dtype=E4M3, config=SmoothQuantConfig()))
        copy_src = jax.random.normal(jax.random.key(4), (P, d), jnp.bfloat16)
        t_copy = gpu_time_ms(jax.jit(lambda v: v + 1), copy_src)
        copy_gbs = 2 * P * d * 2 / (t_copy * 1e-3) / 1e9
        moved = T * d * 2 + P * d + 4 * P
        print(f"== {name} T={T} d={d} P={P}: copy {t_copy*1e3:.1f} us ({copy_gbs:.0f} GB/s); "
              f"must move {moved/1e6:.0f} MB (gathered reads: {(P * d * 3 + 4 * P)/1e6:.0f} MB)",
              flush=True)
        want_q, want_s = poison_then(csr, x, smooth, *csr_args, nbytes=P * d * 2)
        want_q = np.asarray(want_q).view(np.uint8)
        want_s = np.asarray(want_s).view(np.uint32)
        t_csr = gpu_time_ms(csr, x, smooth, *csr_args)
        base = dict(shape=name, variant="csr (previous)", us=t_csr * 1e3,
                    vs_copy=moved / (t_csr * 1e-3) / 1e9 / copy_gbs, equal=True)
        rows_out.append(base)
        print("  " + json.dumps(base), flush=True)
        for label in variant_names:
            try:
                cfg = GatheredQuantConfig.for_width(d, **VARIANTS[label])
                plain = label == "no_smoothing"
                f = jax.jit(lambda x, s, t, g, n, cfg=cfg, plain=plain: quantize_gathered_rows(
                    x, None if plain else s, t, g, n, num_out_rows=P, out_dtype=E4M3,
                    config=cfg))
                args = (x, smooth, plan.token_ids, plan.group_sizes, plan.num_rows)
                q, s = poison_then(f, *args, nbytes=P * d * 2)
                ref_q, ref_s = want_q, want_s
                if plain:
                    ref_q, ref_s = (np.asarray(a) for a in csr(x, None, *csr_args))
                    ref_q, ref_s = ref_q.view(np.uint8), ref_s.view(np.uint32)
                bad_q = int(np.sum(np.asarray(q).view(np.uint8) != ref_q))
                bad_s = int(np.sum(np.asarray(s).view(np.uint32) != ref_s))
                t = gpu_time_ms(f, *args)
            except Exception as e:  # noqa: BLE001 - a variant that does not fit
                print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            row = dict(shape=name, variant=label, cfg=str(cfg), us=t * 1e3,
                       vs_copy=moved / (t * 1e-3) / 1e9 / copy_gbs, vs_csr=t_csr / t,
                       equal=bad_q == 0 and bad_s == 0, bad_q=bad_q, bad_s=bad_s)
            rows_out.append(row)
            print("  " + json.dumps(row), flush=True)
    print("\n| shape | variant | equal to CSR | us | of copy | speed-up vs CSR |")
    print("|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['shape']} | {r['variant']} | {r['equal']} | {r['us']:.1f} | "
              f"{r['vs_copy']:.2f} | {r.get('vs_csr', 1.0):.2f} |")


if __name__ == "__main__":
    names = (sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(",")
    variants = (sys.argv[2] if len(sys.argv) > 2 else ",".join(VARIANTS)).split(",")
    main(names, variants)
