"""Session 11 A/B: setmaxnreg at the top of each role's branch (`_common.role_registers`,
new) against separate branches at the top of the kernel (`_common.rebalance_registers`,
the previous placement), for every kernel that moves registers: the up-proj, dH, the weight
gradients, the engine's 128-row (ping-pong) down-proj and dX~. Same run, same data: each
kernel alone (up-proj, dH), the whole forward and the whole backward (CUPTI GPU time),
bitwise comparison of the two placements' outputs (poisoned), and the new
epilogue-warpgroup up-proj (`UpProjConfig.epilogue_warpgroup`) beside them.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/history/session11/registers_ab.py --out $OUT

Needs `epilogue_wg_experiment.patch` applied (main dropped the kernel and the A/B switch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

import jax

sys.path.insert(0, os.getcwd())
from benchmarks.logs import open_log  # noqa: E402
from benchmarks import backward as bb  # noqa: E402
from benchmarks.forward import SHAPES, dense_bound_ms, gpu_time_ms, poison_then  # noqa: E402
from pallas_moe.kernels import _common  # noqa: E402
from pallas_moe.kernels.dh import dh_kernel  # noqa: E402
from pallas_moe.kernels.moe_backward import BackwardConfig, moe_backward  # noqa: E402
from pallas_moe.kernels.moe_forward import ForwardConfig, moe_forward  # noqa: E402
from pallas_moe.kernels.up_proj import up_proj  # noqa: E402
from pallas_moe.ops.activation import SwiGLU  # noqa: E402


class _GateOnly(SwiGLU):
    """Ablation only: A = the gate pre-activation (no exp, no product)."""

    def apply(self, gate, up):
        return gate


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="7b,30b")
    args = p.parse_args()
    log = open_log(args.out, "registers_ab_log.txt")

    table = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        T, d, n, E, K = shape
        x, w1, w2, plan, go = bb.make_case(shape, seed=len(name) * 7 + 1)
        P, rows = plan.capacity, int(plan.num_rows)
        h = jax.block_until_ready(bb.saved_h(x, plan, w1))
        fcfg, bcfg = ForwardConfig.for_shape(d, n), BackwardConfig.for_shape(d, n)
        up_meta = jax.jit(lambda g, t: _common.tile_meta(g, t, fcfg.up.block_m))(plan.group_sizes, plan.token_ids)
        dh_meta = jax.jit(lambda g, t: _common.tile_meta(g, t, bcfg.dh.block_m))(plan.group_sizes, plan.token_ids)
        epi = dataclasses.replace(fcfg.up, epilogue_warpgroup=True)
        cases = {
            "up-proj": (lambda c=fcfg.up: jax.jit(lambda x, t, g, w, m: up_proj(x, t, g, w, config=c, meta=m)),
                        (x, plan.token_ids, plan.group_sizes, w1, up_meta), P * 3 * n * 2),
            "up-proj epilogue-wg": (lambda c=epi: jax.jit(lambda x, t, g, w, m: up_proj(x, t, g, w, config=c, meta=m)),
                                    (x, plan.token_ids, plan.group_sizes, w1, up_meta), P * 3 * n * 2),
            "dH": (lambda: jax.jit(lambda go, h, t, g, s, w, m: dh_kernel(go, h, t, g, s, w, config=bcfg.dh, meta=m)),
                   (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2, dh_meta), P * 3 * n * 2),
            "forward": (lambda: jax.jit(lambda x, p, a, b: moe_forward(x, p, a, b, config=fcfg)),
                        (x, plan, w1, w2), P * (3 * n + d) * 2),
            "backward": (lambda: jax.jit(lambda *a: moe_backward(*a, config=bcfg)),
                         (x, h, plan, w1, w2, go), P * (5 * n + d) * 2),
        }
        # Ablation (timing only, A is then H's gate half): the SwiGLU math's share of each
        # up-proj, through an activation whose `apply` returns the gate.
        cheap = _GateOnly()
        for kname, c in (("up-proj gate-only act", fcfg.up), ("up-proj epilogue-wg gate-only act", epi)):
            f = jax.jit(lambda x, t, g, w, m, c=c: up_proj(x, t, g, w, config=c, meta=m, activation=cheap))
            t = gpu_time_ms(f, x, plan.token_ids, plan.group_sizes, w1, up_meta) * 1e3
            log(f"  {name} {kname}: {t:.1f} us (ablation)")
            table.append((name, kname, True, t, None))
        outs = {}
        for kname, (build, fargs, nbytes) in cases.items():
            for placement in (False, True):
                if kname == "up-proj epilogue-wg" and not placement:
                    continue  # 4.2x slower with the old placement (run 3)
                _common.REGISTERS_IN_ROLE_BRANCHES = placement
                f = build()
                try:
                    got = poison_then(f, *fargs, nbytes=nbytes)
                    t = gpu_time_ms(f, *fargs) * 1e3
                except Exception as e:  # noqa: BLE001
                    log(f"  {name} {kname} branches={placement}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                leaves = [np.asarray(v) for v in jax.tree.leaves(got)]
                if kname.startswith("up-proj") or kname == "dH":  # real rows only
                    leaves = [v[:rows] if v.shape[0] == P else v for v in leaves]
                key = "up-proj" if kname.startswith("up-proj") else kname
                if key in outs:
                    same = all(np.array_equal(a, b) for a, b in zip(outs[key], leaves))
                else:
                    outs[key], same = leaves, None
                log(f"  {name} {kname} branches={placement}: {t:.1f} us bitwise-vs-first={same}")
                table.append((name, kname, placement, t, same))
        _common.REGISTERS_IN_ROLE_BRANCHES = True
        table.append((name, "dense bound up", None, dense_bound_ms(shape)[0] * 1e3, None))
    with open(os.path.join(args.out, "registers_ab.json"), "w") as fh:
        json.dump(table, fh)
    log("\n| shape | kernel | setmaxnreg in role branches | us | bitwise vs top placement |")
    log("|---|---|---|---|---|")
    for row in table:
        log(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]:.1f} | {row[4]} |")


if __name__ == "__main__":
    main()
