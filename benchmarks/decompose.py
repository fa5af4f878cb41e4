"""Splits the gathering kernels' time into a per-tile fixed cost and a K-loop cost.

For the up-proj and dH at the 7B widths (T=24576, n=256, E=128, K=8, default configs of
`ForwardConfig.for_shape` / `BackwardConfig.for_shape`), times the kernel at several model
widths d (the contraction length of both) and fits `time = fixed + slope * d`: `fixed` is what
a tile costs outside its K loop (launch ramp, prologue, epilogue, tail), which a persistent
kernel with an overlapped epilogue could hide. Also times the up-proj with the X rows laid
out contiguously (token ids = arange(P) into a pre-gathered X), to see what the gather's
scattered rows cost, and without H (inference: A only), to see what the H stores cost.

    PYTHONPATH=. python3 benchmarks/decompose.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import gpu_time_ms
from benchmarks.logs import open_log
from pallas_moe.kernels import _common
from pallas_moe.kernels.dh import dh_kernel
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.kernels.moe_forward import ForwardConfig
from pallas_moe.kernels.up_proj import up_proj
from pallas_moe.routing import topk_plan


def case(T, d, n, E, K, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, d), jnp.float32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n)) / np.sqrt(d)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (E, n, d)) / np.sqrt(n)).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[3], (T, E))
    plan = jax.jit(lambda l: topk_plan(l, K, score="softmax_topk"))(logits)
    do = jax.random.normal(ks[4], (T, d)).astype(jnp.bfloat16)
    return x, w1, w2, plan, do


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--widths", default="768,1536,3072")
    args = ap.parse_args()
    log = open_log(args.out, "decompose_log.txt")
    T, n, E, K = 24576, 256, 128, 8
    rows = []
    for d in [int(w) for w in args.widths.split(",")]:
        x, w1, w2, plan, do = case(T, d, n, E, K)
        fcfg, bcfg = ForwardConfig.for_shape(d, n), BackwardConfig.for_shape(d, n)
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, fcfg.up.tile_rows))(plan.group_sizes, plan.token_ids)
        up = jax.jit(lambda x, t, g, w, m: up_proj(x, t, g, w, config=fcfg.up, meta=m))
        up_inf = jax.jit(lambda x, t, g, w, m: up_proj(x, t, g, w, config=fcfg.up, meta=m, inference=True))
        row = dict(d=d, up_us=1e3 * gpu_time_ms(up, x, plan.token_ids, plan.group_sizes, w1, meta))
        row["up_inference_us"] = 1e3 * gpu_time_ms(up_inf, x, plan.token_ids, plan.group_sizes, w1, meta)
        # Contiguous rows: the same tiles over a pre-gathered X.
        xg = x[plan.token_ids]
        ident = jnp.arange(plan.token_ids.shape[0], dtype=jnp.int32)
        meta_c = jax.jit(lambda g, t: _common.tile_meta(g, t, fcfg.up.tile_rows))(plan.group_sizes, ident)
        row["up_contiguous_us"] = 1e3 * gpu_time_ms(up, xg, ident, plan.group_sizes, w1, meta_c)
        h, _ = up(x, plan.token_ids, plan.group_sizes, w1, meta)
        dmeta = jax.jit(lambda g, t: _common.tile_meta(g, t, bcfg.dh.tile_rows))(plan.group_sizes, plan.token_ids)
        dh = jax.jit(lambda o, h, t, g, s, w, m: dh_kernel(o, h, t, g, s, w, config=bcfg.dh, meta=m))
        row["dh_us"] = 1e3 * gpu_time_ms(dh, do, h, plan.token_ids, plan.group_sizes, plan.scores, w2, dmeta)
        row["num_tiles"] = int(jnp.sum(meta.num_rows > 0))
        log(json.dumps(row))
        rows.append(row)
    ds = np.array([r["d"] for r in rows], float)
    lines = ["| kernel | " + " | ".join(f"d={int(v)} us" for v in ds) + " | fixed us (fit) | K-loop us at d=1536 | fixed share at 1536 |",
             "|---" * (len(ds) + 4) + "|"]
    for key in ("up_us", "up_inference_us", "up_contiguous_us", "dh_us"):
        t = np.array([r[key] for r in rows])
        slope, fixed = np.polyfit(ds, t, 1)
        at = fixed + slope * 1536
        lines.append(f"| {key[:-3]} | " + " | ".join(f"{v:.1f}" for v in t)
                     + f" | {fixed:.1f} | {slope * 1536:.1f} | {fixed / at:.2f} |")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
