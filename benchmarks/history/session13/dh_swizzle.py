"""Session 13: dH with its epilogue tiles as 128-byte-swizzled slabs
(`DHConfig.swizzled_epilogue`) against the untiled default, same run, H100.

    git apply benchmarks/history/session13/dh_swizzled_epilogue_experiment.patch
    PYTHONPATH=. python3 benchmarks/history/session13/dh_swizzle.py [7b,30b]

(The option was measured slower and removed from the library; the patch restores it.)

Hypothesis: the untiled [64, bn] H / dH / A' tiles put a warp's 8 rows in the same banks, so
every wgmma-layout load and store of the epilogue is an 8-way bank conflict (~5k wavefronts
per consumer per tile at bn = 128); swizzled slabs remove them for one TMA ladder per slab.
Each variant's outputs must equal the default's bit for bit on outputs written right after a
poisoned buffer was freed (real rows of dH and A', all of dS); then CUPTI time, three rounds
alternating the variants.
"""
import dataclasses
import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms, poison_then
from pallas_moe.kernels import _common
from pallas_moe.kernels.dh import dh_kernel
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.routing import topk_plan

SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8)}


def main(names):
    table = []
    for name in names:
        T, d, n, E, K = SHAPES[name]
        ks = jax.random.split(jax.random.key(0), 5)
        plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E)))
        P, rows = plan.capacity, int(plan.num_rows)
        go = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
        h = (2 * jax.random.normal(ks[2], (P, 2 * n), jnp.float32)).astype(jnp.bfloat16)
        w2 = (jax.random.normal(ks[3], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
        base = BackwardConfig.for_shape(d, n).dh
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, base.block_m))(plan.group_sizes,
                                                                           plan.token_ids)
        variants = {
            "untiled (default)": base,
            "swizzled": dataclasses.replace(base, swizzled_epilogue=True),
            "untiled, H after K loop": dataclasses.replace(base, early_h=False),
            "swizzled, H after K loop": dataclasses.replace(base, swizzled_epilogue=True,
                                                            early_h=False),
        }
        args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
        fns = {k: jax.jit(lambda *a, c=c: dh_kernel(*a, config=c, meta=meta))
               for k, c in variants.items()}
        want = None
        ok = {}
        for k, f in fns.items():
            out = poison_then(f, *args, nbytes=P * 3 * n * 2)
            got = (np.asarray(out[0][:rows]).view(np.uint16), np.asarray(out[1][:rows]).view(np.uint16),
                   np.asarray(out[2]).view(np.uint32))
            if want is None:
                want = got
            ok[k] = all(np.array_equal(g, w) for g, w in zip(got, want))
            print(f"{name} {k}: equal to default {ok[k]}", flush=True)
        times = {k: [] for k in fns}
        for _ in range(3):
            for k, f in fns.items():
                if ok[k]:
                    times[k].append(gpu_time_ms(f, *args) * 1e3)
        for k in fns:
            row = dict(shape=name, variant=k, equal=ok[k], us=times[k])
            table.append(row)
            print(json.dumps(row), flush=True)
    print("\n| shape | variant | bitwise = default | us (3 rounds) | best |")
    print("|---|---|---|---|---|")
    for r in table:
        us = r["us"]
        print(f"| {r['shape']} | {r['variant']} | {r['equal']} | "
              f"{' / '.join(f'{u:.1f}' for u in us)} | {min(us) if us else float('nan'):.1f} |")


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(","))
