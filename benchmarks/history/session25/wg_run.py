"""Session 25: both weight gradients at one shape with the device's default configs, run
untimed (a target for Nsight Compute, which holds CUPTI): dW1 = X[tok]^T dH, then
dW2 = A'^T dO[tok], each 3 times.

    PYTHONPATH=. python3 benchmarks/history/session25/wg_run.py 30b
"""
import sys

import jax
import jax.numpy as jnp

from benchmarks.forward import SHAPES
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.kernels.weight_grad import weight_grad
from pallas_moe.routing.topk import topk_plan


def inputs(name):
    """(plan, X, dO, dH, A') of a weight-gradient case: top-K over random logits, the
    contiguous operands padded to whole 64-row K-blocks."""
    t, d, n, e, k = SHAPES[name]
    ks = jax.random.split(jax.random.key(0), 5)
    plan = topk_plan(jax.random.normal(ks[0], (t, e)), k)
    p64 = -(-plan.capacity // 64) * 64
    return (plan, jax.random.normal(ks[1], (t, d), jnp.bfloat16),
            jax.random.normal(ks[2], (t, d), jnp.bfloat16),
            jax.random.normal(ks[3], (p64, 2 * n), jnp.bfloat16),
            jax.random.normal(ks[4], (p64, n), jnp.bfloat16))


def main(name):
    _, d, n, _, _ = SHAPES[name]
    plan, x, go, dh, ap = inputs(name)
    cfg = BackwardConfig.for_shape(d, n)
    print(cfg.dw_gate_up, cfg.dw_down, flush=True)
    for gathered, lhs, rhs, c in (("lhs", x, dh, cfg.dw_gate_up), ("rhs", ap, go, cfg.dw_down)):
        f = jax.jit(lambda l, r, tok, g, c=c, gathered=gathered: weight_grad(
            l, r, tok, g, gathered=gathered, out_dtype=jnp.bfloat16, config=c))
        for _ in range(3):
            jax.block_until_ready(f(lhs, rhs, plan.token_ids, plan.group_sizes))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "30b")
