"""Session 30: does the L2 state the step leaves before the up-proj explain why, inside the
step, the ping-pong up-proj beats split-M at 7b-n512 (0.54 vs 0.59 ms) although alone it is
1.13x slower? Times each kernel (CUPTI, per kernel) in one jitted call, three ways:
  alone   - the up-proj only (the plan and tile metadata precomputed);
  warm    - right after the router GEMM `x @ router` (which reads all of X), as in the step;
  flushed - right after a 256 MB elementwise pass (evicts X from the 50 MB L2).
`jax.lax.optimization_barrier` orders the up-proj after the pass without changing X.

    PYTHONPATH=. python3 benchmarks/history/session30/up_context.py [shapes]
"""
import dataclasses
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
import pallas_moe as pm  # noqa: E402
from benchmarks.forward import PINGPONG_UP, SHAPES  # noqa: E402
from benchmarks.step import kernel_breakdown, step_inputs  # noqa: E402
from pallas_moe.kernels import _common  # noqa: E402
from pallas_moe.kernels.moe_forward import ForwardConfig, default_num_sms  # noqa: E402
from pallas_moe.kernels.up_proj import up_proj  # noqa: E402
from pallas_moe.nn.functional import router_logits  # noqa: E402


def contexts(cfg, meta):
    def up(x, plan, w1):
        return up_proj(x, plan.token_ids, plan.group_sizes, w1, config=cfg, meta=meta)

    def alone(x, router, plan, w1, junk):
        return up(x, plan, w1)

    def warm(x, router, plan, w1, junk):
        logits = router_logits(x, router, dtype="bfloat16")
        logits, x = jax.lax.optimization_barrier((logits, x))
        return up(x, plan, w1), logits

    def flushed(x, router, plan, w1, junk):
        junk = junk * 1.5
        junk, x = jax.lax.optimization_barrier((junk, x))
        return up(x, plan, w1), junk

    return {"alone": alone, "warm": warm, "flushed": flushed}


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["7b", "7b-n512", "7b-n1024"]
    rows = []
    for name in names:
        T, d, n, E, K = SHAPES[name]
        x, router, w1, _, _ = step_inputs(SHAPES[name], 0)
        plan = jax.jit(lambda x, r: pm.routing.topk_plan(
            router_logits(x, r, dtype="bfloat16"), K))(x, router)
        junk = jnp.ones((128 * 2**20,), jnp.bfloat16)  # 256 MB
        cfgs = {"split-M": ForwardConfig.for_shape(1536, 1024).up,
                "ping-pong": dataclasses.replace(PINGPONG_UP, pingpong_ctas=default_num_sms())}
        for cname, cfg in cfgs.items():
            meta = jax.jit(lambda g, t, b=cfg.block_m: _common.tile_meta(g, t, b))(
                plan.group_sizes, plan.token_ids)
            for ctx, f in contexts(cfg, meta).items():
                times = dict((k, ms) for k, ms, _ in kernel_breakdown(jax.jit(f), x, router, plan, w1, junk))
                up_ms = next(ms for k, ms in times.items() if "up_proj" in k)
                rows.append((name, cname, ctx, up_ms * 1e3))
                print(rows[-1], {k: round(v * 1e3, 1) for k, v in times.items()}, flush=True)
    print("| shape | kernel | context | up-proj us |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} |")


if __name__ == "__main__":
    main()
