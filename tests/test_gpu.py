"""GPU-only checks of the real `mosaic` backend (run on a Hopper machine: `pytest -m gpu`).

Forward and gradients through `pm.moe_ffn(backend="mosaic")` against the `xla` backend on
fresh random data, for top-K and token-rounding plans, plus run-to-run bitwise determinism.
"""

import jax
import jax.numpy as jnp
import pytest

import pallas_moe as pm

on_hopper = jax.devices()[0].platform == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs a Hopper GPU")]

ROUTERS = {
    "topk": lambda l: pm.routing.topk_plan(l, 4),
    "token_rounding": lambda l: pm.routing.token_rounding_plan(l, 4, tile=128, rounding="nearest"),
}


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_mosaic_matches_xla(router, seed):
    num_tokens, d, n, num_experts = 4096, 512, 256, 16
    k = jax.random.split(jax.random.key(seed), 5)
    logits = jax.random.normal(k[0], (num_tokens, num_experts)).at[:, :2].add(1.0)  # some skew
    x = jax.random.normal(k[1], (num_tokens, d), jnp.bfloat16)
    w1 = (jax.random.normal(k[2], (num_experts, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[3], (num_experts, n, d)) * n**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(k[4], (num_tokens, d), jnp.float32)

    def step(backend):
        def loss(logits, x, w1, w2):
            out = pm.moe_ffn(x, ROUTERS[router](logits), w1, w2, backend=backend)
            return jnp.sum(out.astype(jnp.float32) * cot), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    (_, out), grads = step("mosaic")(logits, x, w1, w2)
    (_, ref_out), ref_grads = step("xla")(logits, x, w1, w2)
    assert rel_err(out, ref_out) < 1e-2
    for name, g, r in zip(["logits", "x", "w_gate_up", "w_down"], grads, ref_grads):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
        assert rel_err(g, r) < 2e-2, name
    (_, again), grads_again = step("mosaic")(logits, x, w1, w2)
    assert bool(jnp.array_equal(out, again)), "the forward must be bitwise reproducible"
    for g, h in zip(grads, grads_again):
        assert bool(jnp.array_equal(g, h)), "gradients must be bitwise reproducible"
