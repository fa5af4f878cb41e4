"""Session 14: where the ping-pong dH kernel's time goes (issue 9). Timing only: the
ablations drop parts of the epilogue, so their outputs are wrong by design.

    git apply benchmarks/history/session14/dh_pingpong_ablation.patch
    PYTHONPATH=. python3 benchmarks/history/session14/dh_pingpong_ablation.py [7b,30b]

Variants (`dh._ABLATE`, read when a kernel is traced): "noepi" (no H load, no epilogue at
all: the K loops and the hand-overs), "noh" (no H load), "nostore" (no TMA stores of dH and
A'), "nomath" (dSwiGLU replaced by pass-throughs). Three rounds alternating, CUPTI time.
"""
import dataclasses
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

SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8)}


def main(names):
    num_sms = jax.devices()[0].core_count
    table = []
    for name in names:
        T, d, n, E, K = SHAPES[name]
        ks = jax.random.split(jax.random.key(14), 5)
        plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E)))
        P = plan.capacity
        go = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
        h = (2 * jax.random.normal(ks[2], (P, 2 * n), jnp.float32)).astype(jnp.bfloat16)
        w2 = (jax.random.normal(ks[3], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
        base = BackwardConfig.for_shape(d, n).dh
        coop = dataclasses.replace(base, persistent_ctas=num_sms, early_h=False,
                                   gather_completion="wait_group")
        pp = dataclasses.replace(coop, pingpong=True, num_stages=4)
        variants = {
            "cooperative": (coop, set()), "cooperative, noepi": (coop, {"noepi"}),
            "ping-pong": (pp, set()), "ping-pong, noepi": (pp, {"noepi"}),
            "ping-pong, noh": (pp, {"noh"}), "ping-pong, nostore": (pp, {"nostore"}),
            "ping-pong, nomath": (pp, {"nomath"}),
            "cooperative 4 stages": (dataclasses.replace(coop, num_stages=4), set()),
        }
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, base.block_m))(plan.group_sizes,
                                                                           plan.token_ids)
        args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
        fns = {}
        for k, (cfg, ab) in variants.items():
            dh_module._ABLATE.clear()
            dh_module._ABLATE.update(ab)
            f = jax.jit(lambda *a, cfg=cfg: dh_kernel(*a, config=cfg, meta=meta))
            jax.block_until_ready(f(*args))
            fns[k] = f
        dh_module._ABLATE.clear()
        times = {k: [] for k in fns}
        for _ in range(3):
            for k, f in fns.items():
                times[k].append(gpu_time_ms(f, *args) * 1e3)
        for k in fns:
            row = dict(shape=name, variant=k, us=times[k], best=min(times[k]))
            table.append(row)
            print(json.dumps(row), flush=True)
    print("\n| shape | variant | us (3 rounds) | best |")
    print("|---|---|---|---|")
    for r in table:
        print(f"| {r['shape']} | {r['variant']} | {' / '.join(f'{u:.1f}' for u in r['us'])} | "
              f"{r['best']:.1f} |")


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(","))
