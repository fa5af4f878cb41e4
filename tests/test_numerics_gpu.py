"""GPU-only numerics checks of the real `mosaic` backend (Hopper: `pytest -m gpu`).

- Each aggregation mode's output is bitwise the numpy reference of its order applied to the
  kernels' own expert rows.
- Forward and every gradient (router logits, x, both weights) are bitwise identical from
  run to run, and after recompiling, at SonicMoE's 7B shape, for top-K and token rounding,
  in every aggregation mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe as pm
from pallas_moe.numerics import AGGREGATIONS, Numerics
from tests.test_numerics import aggregate_np, assert_bitwise, expert_rows

on_hopper = jax.devices()[0].platform == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs a Hopper GPU")]

ROUTERS = {
    "topk": lambda logits, k: pm.routing.topk_plan(logits, k),
    "token_rounding": lambda logits, k: pm.routing.token_rounding_plan(logits, k, tile=128),
}


def inputs(seed, num_tokens, d, n, num_experts):
    k = jax.random.split(jax.random.key(seed), 5)
    logits = jax.random.normal(k[0], (num_tokens, num_experts)).at[:, :2].add(1.0)
    x = jax.random.normal(k[1], (num_tokens, d), jnp.bfloat16)
    w1 = (jax.random.normal(k[2], (num_experts, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[3], (num_experts, n, d)) * n**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(k[4], (num_tokens, d), jnp.float32)
    return logits, x, w1, w2, cot


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_mosaic_output_is_the_mode_sum_of_its_expert_rows(router):
    logits, x, w1, w2, _ = inputs(0, 2048, 512, 256, 16)
    plan = ROUTERS[router](logits, 4)
    y = expert_rows(x, plan, w1, w2, "mosaic")
    for mode in AGGREGATIONS:
        out = pm.moe_ffn(x, plan, w1, w2, backend="mosaic", numerics=Numerics(aggregation=mode))
        # On the GPU the fp32 mode's multiply and add are one FMA (the compiler contracts them).
        want = aggregate_np(y, plan, mode, fused_multiply_add=True)
        assert_bitwise(out, want, jnp.bfloat16)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_bitwise_run_to_run_at_the_7b_shape(router, mode):
    # One (router, mode) pair per test: each compiles the whole 7B step twice (~1 min on
    # the H100), so a pair fits in a short GPU call.
    num_tokens, d, n, num_experts, k = 24576, 1536, 256, 128, 8
    logits, x, w1, w2, cot = inputs(1, num_tokens, d, n, num_experts)

    def step():
        def loss(logits, x, w1, w2):
            plan = ROUTERS[router](logits, k)
            out = pm.moe_ffn(x, plan, w1, w2, backend="mosaic", numerics=Numerics(aggregation=mode))
            return jnp.sum(out.astype(jnp.float32) * cot), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    f = step()
    (_, out), grads = f(logits, x, w1, w2)
    first = [np.asarray(a) for a in (out, *grads)]
    (_, out), grads = f(logits, x, w1, w2)
    for name, a, b in zip(["out", "logits", "x", "w_gate_up", "w_down"], first, (out, *grads)):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=f"{mode}: {name} (same executable)")
    jax.clear_caches()
    (_, out), grads = step()(logits, x, w1, w2)
    for name, a, b in zip(["out", "logits", "x", "w_gate_up", "w_down"], first, (out, *grads)):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=f"{mode}: {name} (recompiled)")


def test_unfused_swiglu_stays_close_to_the_fused_one():
    # On the GPU the epilogue's sigmoid may differ from XLA's in the last bit of A; the
    # outputs must still agree to bf16 rounding.
    logits, x, w1, w2, _ = inputs(2, 4096, 512, 256, 16)
    plan = pm.routing.topk_plan(logits, 4)
    fused = pm.moe_ffn(x, plan, w1, w2, backend="mosaic")
    unfused = pm.moe_ffn(x, plan, w1, w2, backend="mosaic", numerics=Numerics(fuse_swiglu=False))
    a, b = np.asarray(fused, np.float32), np.asarray(unfused, np.float32)
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-2
