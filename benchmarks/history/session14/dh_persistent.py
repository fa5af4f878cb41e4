"""Session 14: the persistent dH kernels (`DHConfig.persistent_ctas`, `pingpong`) against the one-CTA-
per-tile kernel (issue 9), same run, same inputs.

    PYTHONPATH=. python3 benchmarks/history/session14/dh_persistent.py [7b,30b,qwen3]

Every variant's outputs are compared bitwise with the default's (rows < num_rows of dH and
A', all of dS) after poisoning the allocator with NaN, then timed in three alternating
rounds (CUPTI, `benchmarks.forward.gpu_time_ms`). The ping-pong variants need the kernel
that was measured and removed: `git apply benchmarks/history/session14/dh_pingpong_experiment.patch`. The dense bound is a same-run batched
matmul of dH's FLOPs (2 P n d).
"""
import dataclasses
import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms
from pallas_moe.kernels import _common
from pallas_moe.kernels.dh import dh_kernel
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.routing import topk_plan

SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8),
          "qwen3": (16384, 2048, 768, 128, 8)}


def variants(base, num_sms, which="all"):
    per = dict(persistent_ctas=num_sms, early_h=False)
    if which == "epcols":  # call 5: the ping-pong epilogue in narrower chunks
        coop = dataclasses.replace(base, gather_completion="wait_group", **per)
        pp = dataclasses.replace(coop, pingpong=True, num_stages=4)
        return {
            "per-tile (default)": dataclasses.replace(base, persistent_ctas=0, early_h=True),
            "persistent cooperative": coop,
            **{f"ping-pong, {c}-column chunks": dataclasses.replace(pp, epilogue_cols=c)
               for c in (8, 16, 32)},
        }
    return {
        "per-tile (default)": base,
        "per-tile, H after the K loop": dataclasses.replace(base, early_h=False),
        "persistent, lagged publish": dataclasses.replace(base, gather_completion="wait_group", **per),
        "persistent, slot mbarriers": dataclasses.replace(base, gather_completion="mbarrier", **per),
        "ping-pong 4 stages, lagged publish": dataclasses.replace(
            base, gather_completion="wait_group", pingpong=True, num_stages=4, **per),
        "ping-pong 4 stages, slot mbarriers": dataclasses.replace(
            base, gather_completion="mbarrier", pingpong=True, num_stages=4, **per),
    }


def poison(nbytes):
    jax.block_until_ready(jnp.full((nbytes // 4,), jnp.nan, jnp.float32))


def main(names, which="all"):
    num_sms = jax.devices()[0].core_count
    table = []
    for name in names:
        T, d, n, E, K = SHAPES[name]
        ks = jax.random.split(jax.random.key(14), 5)
        logits = jax.random.normal(ks[0], (T, E))
        plan = jax.jit(lambda l: topk_plan(l, K))(logits)
        P = plan.capacity
        rows = int(plan.num_rows)
        go = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
        h = (2 * jax.random.normal(ks[2], (P, 2 * n), jnp.float32)).astype(jnp.bfloat16)
        w2 = (jax.random.normal(ks[3], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
        base = BackwardConfig.for_shape(d, n).dh
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, base.block_m))(plan.group_sizes,
                                                                           plan.token_ids)
        args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
        fns, first = {}, None
        for k, cfg in variants(base, num_sms, which).items():
            f = jax.jit(lambda *a, cfg=cfg: dh_kernel(*a, config=cfg, meta=meta))
            poison(P * 3 * n * 2 * 2)
            out = [np.asarray(o) for o in f(*args)]
            out = (out[0][:rows], out[1][:rows], out[2])
            finite = all(np.all(np.isfinite(o.astype(np.float32))) for o in out)
            same = first is None or all(np.array_equal(a, b) for a, b in zip(out, first))
            first = first or out
            print(json.dumps(dict(shape=name, variant=k, finite=bool(finite), bitwise=bool(same))),
                  flush=True)
            fns[k] = f
        a = jax.random.normal(ks[4], (E, P // E, d), jnp.bfloat16)
        b = jax.random.normal(ks[4], (E, d, n), jnp.bfloat16)
        bound = gpu_time_ms(jax.jit(lambda a, b: jnp.einsum("epk,ekn->epn", a, b)), a, b) * 1e3
        times = {k: [] for k in fns}
        for _ in range(3):
            for k, f in fns.items():
                times[k].append(gpu_time_ms(f, *args) * 1e3)
        base_best = min(times["per-tile (default)"])
        for k in fns:
            row = dict(shape=name, variant=k, us=times[k], best=min(times[k]), bound=bound,
                       vs_default=base_best / min(times[k]), vs_bound=bound / min(times[k]))
            table.append(row)
            print(json.dumps(row), flush=True)
    print("\n| shape | variant | us (3 rounds) | best | default / this | bound / this |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['shape']} | {r['variant']} | {' / '.join(f'{u:.1f}' for u in r['us'])} | "
              f"{r['best']:.1f} | {r['vs_default']:.3f} | {r['vs_bound']:.3f} |")


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,30b,qwen3").split(","),
         sys.argv[2] if len(sys.argv) > 2 else "all")
