"""Session 13: where dH's time outside its K loop goes (issue 9). Timing only: each
ablation drops one part of the epilogue, so its outputs are wrong by design.

    git apply benchmarks/history/session13/dh_ablation.patch
    PYTHONPATH=. python3 benchmarks/history/session13/dh_ablation.py [7b,30b]

Variants (`dh._ABLATE`, read when a kernel is traced): the default; "nostore" (no TMA
stores of dH and A'; dS still stored); "nomath" (dSwiGLU replaced by pass-throughs, a row
sum for dS); "noh" (H never loaded: the epilogue reads whatever the SMEM holds); all three.
Three rounds alternating the variants, CUPTI time; the dense bound of dH's FLOPs is
2 P n d over a same-run batched matmul of the same shape.
"""
import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms
from pallas_moe.kernels import _common, dh as dh_module
from pallas_moe.kernels.dh import dh_kernel
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.routing import topk_plan

SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8),
          # The 7B widths at other d: time = fixed + slope * d separates the K loop.
          "7b_d768": (24576, 768, 256, 128, 8), "7b_d3072": (24576, 3072, 256, 128, 8)}
VARIANTS = {"default": set(), "nostore": {"nostore"}, "nomath": {"nomath"}, "noh": {"noh"},
            "none of the three": {"nostore", "nomath", "noh"}}


def main(names, variants=None):
    global VARIANTS
    if variants:
        VARIANTS = {k: v for k, v in VARIANTS.items() if k in variants}
    table = []
    for name in names:
        T, d, n, E, K = SHAPES[name]
        ks = jax.random.split(jax.random.key(0), 5)
        plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E)))
        P = plan.capacity
        go = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
        h = (2 * jax.random.normal(ks[2], (P, 2 * n), jnp.float32)).astype(jnp.bfloat16)
        w2 = (jax.random.normal(ks[3], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
        cfg = BackwardConfig.for_shape(d, n).dh
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.block_m))(plan.group_sizes,
                                                                          plan.token_ids)
        args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
        fns = {}
        for k, ab in VARIANTS.items():
            dh_module._ABLATE.clear()
            dh_module._ABLATE.update(ab)
            f = jax.jit(lambda *a: dh_kernel(*a, config=cfg, meta=meta))
            jax.block_until_ready(f(*args))  # traced and compiled with this ablation
            fns[k] = f
        dh_module._ABLATE.clear()
        # A dense batched matmul of dH's FLOPs (P x d times d x n, per expert groups of P/E).
        a = jax.random.normal(ks[4], (E, P // E, d), jnp.bfloat16)
        b = jax.random.normal(ks[4], (E, d, n), jnp.bfloat16)
        bound = gpu_time_ms(jax.jit(lambda a, b: jnp.einsum("epk,ekn->epn", a, b)), a, b) * 1e3
        times = {k: [] for k in fns}
        for _ in range(3):
            for k, f in fns.items():
                times[k].append(gpu_time_ms(f, *args) * 1e3)
        for k in fns:
            row = dict(shape=name, variant=k, us=times[k], best=min(times[k]), bound=bound)
            table.append(row)
            print(json.dumps(row), flush=True)
    print("\n| shape | variant | us (3 rounds) | best | dense bound |")
    print("|---|---|---|---|---|")
    for r in table:
        print(f"| {r['shape']} | {r['variant']} | {' / '.join(f'{u:.1f}' for u in r['us'])} | "
              f"{r['best']:.1f} | {r['bound']:.1f} |")


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(","),
         sys.argv[2].split(",") if len(sys.argv) > 2 else None)
