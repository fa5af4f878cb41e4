"""`pm.moe_ffn(backend="interpret")`: the kernels end to end, forward and gradients, vs `xla`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe as pm


def make_inputs(seed, num_tokens, d, n, num_experts, skew=0.0):
    k = jax.random.split(jax.random.key(seed), 5)
    logits = jax.random.normal(k[0], (num_tokens, num_experts)).at[:, 0].add(skew)
    x = jax.random.normal(k[1], (num_tokens, d), jnp.bfloat16)
    w1 = (jax.random.normal(k[2], (num_experts, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[3], (num_experts, n, d)) * n**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(k[4], (num_tokens, d), jnp.bfloat16)
    return logits, x, w1, w2, cot


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


ROUTERS = {
    "topk": lambda l: pm.routing.topk_plan(l, 2),
    "token_rounding": lambda l: pm.routing.token_rounding_plan(l, 2, tile=16, rounding="nearest"),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_interpret_backend_forward_and_gradients_match_xla(router):
    logits, x, w1, w2, cot = make_inputs(0, 40, 64, 64, 4, skew=1.5)

    def loss(backend):
        def f(logits, x, w1, w2):
            out = pm.moe_ffn(x, ROUTERS[router](logits), w1, w2, backend=backend)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)

    (_, out), grads = loss("interpret")(logits, x, w1, w2)
    (_, ref_out), ref_grads = loss("xla")(logits, x, w1, w2)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    assert rel_err(out, ref_out) < 1e-2
    for name, g, r in zip(["logits", "x", "w_gate_up", "w_down"], grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        assert rel_err(g, r) < 2e-2, name


def test_kernel_backends_reject_unaligned_widths():
    logits, x, w1, w2, _ = make_inputs(1, 16, 96, 64, 2)
    plan = pm.routing.topk_plan(logits, 1)
    with pytest.raises(ValueError, match="d=96 must be a multiple of 64"):
        pm.moe_ffn(x, plan, w1, w2, backend="interpret")


def test_interpret_backend_with_a_plan_that_dropped_every_row():
    logits, x, w1, w2, cot = make_inputs(2, 16, 64, 64, 4)
    plan = pm.routing.token_rounding_plan(logits, 1, tile=64, rounding="down")
    assert int(plan.num_rows) == 0

    def loss(x, w1, w2, scores):
        out = pm.moe_ffn(x, plan.with_scores(scores), w1, w2, backend="interpret")
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w1, w2, plan.scores)
    assert not np.any(np.asarray(out, np.float32))
    for g in grads:
        assert not np.any(np.asarray(g, np.float32)), "an empty plan must give exactly zero gradients"


def test_backend_resolution_reads_the_aot_target():
    """`auto` picks the kernels for a Hopper target named by an abstract mesh (lowering for
    cuda from a CPU host), and `mosaic` without one is a clear error."""
    from pallas_moe.ops.moe_ffn import resolve_backend
    from tests.cuda_target import h100_target

    with h100_target():
        assert resolve_backend("auto") == "mosaic"
        assert resolve_backend("mosaic") == "mosaic"
    if jax.default_backend() != "gpu":
        assert resolve_backend("auto") == "xla"
        with pytest.raises(ValueError, match="backend='mosaic' needs a Hopper GPU"):
            resolve_backend("mosaic")
