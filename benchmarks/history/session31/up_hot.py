"""Session 31: session 30's context test (call 1) found the L2 state before the up-proj
does not explain why, inside the step, split-M loses to the ping-pong at 7b-n512 (alone,
warm after the router GEMM, or after an L2 flush: split-M 531-535 us, ping-pong 557-568).
Next candidate: clocks. Inside the step the up-proj follows milliseconds of tensor-core
work (the previous step's backward), which lowers the SM clock under the power limit; a
kernel limited by its MMA issue rate loses more from that than one limited by L2. Times
each kernel (CUPTI) alone and right after ~9 ms of dense bf16 matmuls (`hot`), ordered by
`optimization_barrier`; the calling script samples nvidia-smi's SM clock meanwhile.

    PYTHONPATH=. python3 benchmarks/history/session31/up_hot.py [shapes]
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

HOT_MATMULS = 6  # [8192, 8192] @ [8192, 8192] bf16: ~1.1 TFLOP, ~1.5 ms each


def contexts(cfg, meta):
    def up(x, plan, w1):
        return up_proj(x, plan.token_ids, plan.group_sizes, w1, config=cfg, meta=meta)

    def alone(x, plan, w1, m):
        return up(x, plan, w1)

    def hot(x, plan, w1, m):
        for _ in range(HOT_MATMULS):
            m = (m @ m) * 0.5
        m, x = jax.lax.optimization_barrier((m, x))
        return up(x, plan, w1), m

    return {"alone": alone, "hot": hot}


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["7b-n512", "7b"]
    rows = []
    m = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16) * 0.01
    for name in names:
        T, d, n, E, K = SHAPES[name]
        x, router, w1, _, _ = step_inputs(SHAPES[name], 0)
        plan = jax.jit(lambda x, r: pm.routing.topk_plan(
            router_logits(x, r, dtype="bfloat16"), K))(x, router)
        cfgs = {"split-M": ForwardConfig.for_shape(1536, 1024).up,
                "ping-pong": dataclasses.replace(PINGPONG_UP, pingpong_ctas=default_num_sms())}
        for repeat in range(2):  # both orders of the two contexts' runs
            for cname, cfg in cfgs.items():
                meta = jax.jit(lambda g, t, b=cfg.block_m: _common.tile_meta(g, t, b))(
                    plan.group_sizes, plan.token_ids)
                ctxs = list(contexts(cfg, meta).items())
                for ctx, f in (ctxs if repeat == 0 else ctxs[::-1]):
                    times = dict((k, ms) for k, ms, _ in kernel_breakdown(jax.jit(f), x, plan, w1, m))
                    up_ms = next(ms for k, ms in times.items() if "up_proj" in k)
                    rows.append((name, cname, ctx, repeat, up_ms * 1e3))
                    print(rows[-1], {k: round(v * 1e3, 1) for k, v in times.items()}, flush=True)
    print("| shape | kernel | context | run | up-proj us |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} |")


if __name__ == "__main__":
    main()
