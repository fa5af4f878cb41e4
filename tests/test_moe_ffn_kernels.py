"""`pm.moe_ffn(backend="interpret")`: the kernels end to end, forward and gradients, vs `xla`."""

import dataclasses

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


def test_tile_metadata_is_computed_once_per_plan(monkeypatch):
    """Forward and backward share the plan's tile metadata (`kernels.schedules`): tracing a
    gradient derives each (kind, block size) once, and the backward reuses the forward's."""
    from pallas_moe.kernels import _common, schedules
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig

    calls = []
    for module, name in ((_common, "tile_meta"), (_common, "aligned_tile_meta"), (schedules, "k_block_meta")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(
            (_n, a[-1])) or _f(*a, **kw))
    logits, x, w1, w2, cot = make_inputs(0, 40, 64, 64, 4)
    plan = pm.routing.topk_plan(logits, 2)
    forward, backward = ForwardConfig.for_shape(64, 64, num_sms=4), BackwardConfig.for_shape(64, 64, num_sms=4)
    config = pm.kernels.KernelConfig(forward=forward, backward=backward)

    def loss(x, w1, w2):
        out = pm.moe_ffn(x, plan, w1, w2, backend="interpret", config=config)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2)  # traces both passes
    want = {("tile_meta", forward.up.block_m), ("tile_meta", backward.dh.block_m),
            ("aligned_tile_meta", forward.down.block_m), ("aligned_tile_meta", backward.dx.block_m),
            ("k_block_meta", backward.dw_down.block_k)}
    assert sorted(calls) == sorted(want), calls


def test_precomputed_schedules_must_match_the_config():
    from pallas_moe.kernels.moe_backward import BackwardConfig, moe_backward
    from pallas_moe.kernels.moe_forward import ForwardConfig, moe_forward
    from pallas_moe.kernels.schedules import plan_schedules

    logits, x, w1, w2, cot = make_inputs(0, 40, 64, 64, 4)
    plan = pm.routing.topk_plan(logits, 2)
    forward, backward = ForwardConfig.for_shape(64, 64, num_sms=4), BackwardConfig.for_shape(64, 64, num_sms=4)
    other = lambda block: 64 if block == 128 else 128  # noqa: E731 - the other valid block
    stale = plan_schedules(plan, dataclasses.replace(
        forward, up=dataclasses.replace(forward.up, block_m=other(forward.up.block_m))), backward)
    with pytest.raises(ValueError, match="schedules.up was computed for block_m="):
        jax.eval_shape(lambda x: moe_forward(x, plan, w1, w2, interpret=True, config=forward,
                                             schedules=stale), x)
    h = jnp.zeros((plan.capacity, 128), jnp.bfloat16)
    stale = plan_schedules(plan, forward, dataclasses.replace(
        backward, dx=dataclasses.replace(backward.dx, block_m=other(backward.dx.block_m))))
    with pytest.raises(ValueError, match="schedules.dx was computed for block_m="):
        jax.eval_shape(lambda x: moe_backward(x, h, plan, w1, w2, cot, interpret=True, config=backward,
                                              schedules=stale), x)


def test_op_with_shared_schedules_lowers_for_cuda_7b():
    """Routing, forward and backward of the 7B layer through `backend="mosaic"` (schedules
    computed once in the forward, saved for the backward) lower for an H100."""
    from tests.cuda_target import h100_target

    T, d, n, E, K = 24576, 1536, 256, 128, 8

    def step(logits, x, w1, w2):
        def loss(logits, x, w1, w2):
            plan = pm.routing.token_rounding_plan(logits, K, tile=128, impl="kernel")
            return jnp.sum(pm.moe_ffn(x, plan, w1, w2, backend="mosaic").astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(logits, x, w1, w2)

    args = (jax.ShapeDtypeStruct((T, E), jnp.float32), jax.ShapeDtypeStruct((T, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((E, d, 2 * n), jnp.bfloat16), jax.ShapeDtypeStruct((E, n, d), jnp.bfloat16))
    with h100_target():
        jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))
