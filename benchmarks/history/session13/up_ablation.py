"""Session 13: where the up-proj's time outside its K loop goes (issue 16), as
`dh_ablation.py` does for dH. Timing only: the ablations' outputs are wrong by design.

    git apply benchmarks/history/session13/up_ablation.patch
    PYTHONPATH=. python3 benchmarks/history/session13/up_ablation.py [7b,7b_d768,7b_d3072,30b]

Variants: the training up-proj (H and A written); inference (A only); "nostore" (no TMA
stores); "nomath" (SwiGLU replaced by casts); both. Three rounds alternating, CUPTI time;
dense bound = a batched matmul of the up-proj's FLOPs in the same run.
"""
import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms
import importlib

from pallas_moe.kernels import _common
from pallas_moe.kernels.moe_forward import ForwardConfig
from pallas_moe.kernels.up_proj import up_proj
from pallas_moe.routing import topk_plan

# `pallas_moe.kernels.up_proj` the attribute is the function; the module holds `_ABLATE`.
up_module = importlib.import_module("pallas_moe.kernels.up_proj")

SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8),
          "7b_d768": (24576, 768, 256, 128, 8), "7b_d3072": (24576, 3072, 256, 128, 8)}
VARIANTS = {"training (default)": (set(), False), "inference": (set(), True),
            "nostore": ({"nostore"}, False), "nomath": ({"nomath"}, False),
            "neither": ({"nostore", "nomath"}, False)}


def main(names):
    table = []
    for name in names:
        T, d, n, E, K = SHAPES[name]
        ks = jax.random.split(jax.random.key(0), 4)
        plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E)))
        P = plan.capacity
        x = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
        w1 = (jax.random.normal(ks[2], (E, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
        cfg = ForwardConfig.for_shape(d, n).up
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.block_m))(plan.group_sizes,
                                                                          plan.token_ids)
        args = (x, plan.token_ids, plan.group_sizes, w1)
        fns = {}
        for k, (ab, inference) in VARIANTS.items():
            up_module._ABLATE.clear()
            up_module._ABLATE.update(ab)
            f = jax.jit(lambda *a, inf=inference: up_proj(*a, config=cfg, meta=meta,
                                                          inference=inf))
            jax.block_until_ready(f(*args))
            fns[k] = f
        up_module._ABLATE.clear()
        a = jax.random.normal(ks[3], (E, P // E, d), jnp.bfloat16)
        b = jax.random.normal(ks[3], (E, d, 2 * n), jnp.bfloat16)
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
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,7b_d768,7b_d3072,30b").split(","))
