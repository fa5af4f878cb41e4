"""`pm.moe_ffn(backend="interpret")`: the kernels end to end, forward and gradients, vs `xla`."""

import dataclasses
import functools

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


@pytest.mark.parametrize("router", [
    # CI time: token-rounding plans on the interpreted kernels are also covered by
    # test_kernels_bwd's and test_kernels_forward's token-rounding tests.
    pytest.param("token_rounding", marks=pytest.mark.slow), "topk",
])
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


# CI time: the kernel is checked bitwise in test_kernels_up_proj (persistent split-M, race
# detector), its schedules by test_persistent_split_m_schedules_trace below, and the op on
# the GPU by test_gpu's test_mosaic_matches_xla_at_d_2048; this is the interpret-mode extra.
@pytest.mark.slow
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_interpret_backend_with_the_persistent_split_m_up_proj_matches_xla(cluster_m):
    """The op with the up-proj every card runs above d = 1536 (persistent split-M, 128-row
    items: `ForwardConfig.for_shape`), whose 128-row tiles differ from dH's 64 (two row-tile
    schedules per plan): forward and every gradient against the xla backend, on the inputs
    of test_interpret_backend_forward_and_gradients_match_xla (ragged, skewed groups). The
    kernel's row patterns (items over 64 and 128 rows): test_kernels_up_proj's persistent
    split-M test. `cluster_m=2`: the up-proj's items on clusters of two CTAs (tiles of
    twice their block rows)."""
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.up_proj import UpProjConfig

    logits, x, w1, w2, cot = make_inputs(0, 40, 64, 64, 4, skew=1.5)
    up = UpProjConfig(block_m=128, block_n=64, num_stages=3, num_consumers=2,
                      pingpong_ctas=3 if cluster_m == 1 else 4, cluster_m=cluster_m)
    forward = dataclasses.replace(ForwardConfig.for_shape(64, 64, num_sms=3), up=up)
    backward = BackwardConfig.for_shape(64, 64, num_sms=3)
    config = pm.kernels.KernelConfig(forward=forward, backward=backward)

    def loss(backend):
        def f(logits, x, w1, w2):
            out = pm.moe_ffn(x, ROUTERS["topk"](logits), w1, w2, backend=backend,
                             config=config if backend == "interpret" else None)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)

    (_, out), grads = loss("interpret")(logits, x, w1, w2)
    (_, ref_out), ref_grads = loss("xla")(logits, x, w1, w2)
    assert rel_err(out, ref_out) < 1e-2
    for name, g, r in zip(["logits", "x", "w_gate_up", "w_down"], grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        assert rel_err(g, r) < 2e-2, name


def test_undifferentiated_call_writes_no_h_and_matches_the_differentiated_one():
    """Where `moe_ffn` is not differentiated (serving), the up-proj runs with
    `inference=True` and writes no H [P, 2n]; under `jax.grad` it writes H for the backward.
    Both give bitwise the same output."""
    logits, x, w1, w2, cot = make_inputs(2, 40, 64, 64, 4)
    plan = ROUTERS["topk"](logits)
    h_type = f"bf16[{plan.capacity},{2 * 64}]"  # H: P rows of gate and up columns

    def out_only(x, w1, w2):
        return pm.moe_ffn(x, plan, w1, w2, backend="interpret")

    def loss(x, w1, w2):
        out = out_only(x, w1, w2)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    assert h_type not in str(jax.make_jaxpr(out_only)(x, w1, w2))
    assert h_type in str(jax.make_jaxpr(jax.grad(loss, has_aux=True))(x, w1, w2))
    served = out_only(x, w1, w2)
    # The differentiated forward (the custom VJP's fwd rule, which writes H); its pullback,
    # an interpreted backward, is never called (CI time).
    trained, _ = jax.vjp(out_only, x, w1, w2)
    assert bool(jnp.array_equal(served, trained))


def test_kernel_backends_reject_unaligned_widths():
    logits, x, w1, w2, _ = make_inputs(1, 16, 96, 64, 2)
    plan = pm.routing.topk_plan(logits, 1)
    with pytest.raises(ValueError, match="d=96 must be a multiple of 64"):
        pm.moe_ffn(x, plan, w1, w2, backend="interpret")


@pytest.mark.slow  # CI time: test_expert_biases_with_a_plan_that_dropped_every_row runs the same empty plan through the op, same checks
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


CLAMPED = pm.ops.activation.SwiGLU.clamped(alpha=1.702, limit=0.75)  # hit on both sides

BIAS_ROUTERS = {
    # Expert 1 gets no rows (an empty expert); groups are ragged.
    "topk": lambda l: pm.routing.topk_plan(l.at[:, 1].set(-1e9), 2),
    # Token rounding leaves padding rows.
    "token_rounding": lambda l: pm.routing.token_rounding_plan(l, 2, tile=16, rounding="nearest"),
}


def bias_loss(backend, router, activation, cot):
    def f(logits, x, w1, w2, b1, b2):
        out = pm.moe_ffn(x, BIAS_ROUTERS[router](logits), w1, w2, b_gate_up=b1, b_down=b2,
                         activation=activation, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    return jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True)


@pytest.mark.parametrize(
    "router",
    # CI time: token-rounding plans' padding rows on the kernels run in
    # test_kernels_bwd's test_backward_token_rounding_with_padding_and_empty_expert and
    # test_numerics' mode-sum test (the whole forward on the interpret backend); the biases
    # and the clamp on top-K plans here.
    [pytest.param(r, marks=pytest.mark.slow) if r == "token_rounding" else r
     for r in sorted(BIAS_ROUTERS)])
def test_expert_biases_and_clamped_swiglu_on_the_kernels_match_xla(router):
    """gpt-oss options on the kernels: forward and every gradient (router logits, x, both
    weights, both biases) vs the `xla` backend, with H values past the clamp on both sides."""
    logits, x, w1, w2, cot = make_inputs(3, 40, 64, 64, 4, skew=1.5)
    kb = jax.random.split(jax.random.key(4), 2)
    b1 = (0.5 * jax.random.normal(kb[0], (4, 128))).astype(jnp.bfloat16)
    b2 = (0.5 * jax.random.normal(kb[1], (4, 64))).astype(jnp.bfloat16)
    args = (logits, x, w1, w2, b1, b2)
    (_, out), grads = bias_loss("interpret", router, CLAMPED, cot)(*args)
    (_, ref_out), ref_grads = bias_loss("xla", router, CLAMPED, cot)(*args)
    plan = BIAS_ROUTERS[router](logits)
    h = jnp.einsum("pd,pdf->pf", x[plan.token_ids].astype(jnp.float32),
                   w1[jnp.minimum(plan.expert_ids, 3)].astype(jnp.float32))
    h = np.asarray(h + b1[jnp.minimum(plan.expert_ids, 3)].astype(jnp.float32))[
        np.asarray(plan.row_is_valid)]
    assert np.mean(h[:, :64] > 0.75) > 0.1 and np.mean(np.abs(h[:, 64:]) > 0.75) > 0.2
    if router == "topk":
        assert int(plan.group_sizes[1]) == 0
    else:
        assert int(plan.num_rows) < plan.capacity
    assert rel_err(out, ref_out) < 1e-2
    names = ["logits", "x", "w_gate_up", "w_down", "b_gate_up", "b_down"]
    for name, g, r in zip(names, grads, ref_grads):
        assert g.dtype == r.dtype, name
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        assert rel_err(g, r) < 2e-2, name
    if router == "topk":  # the empty expert gets exactly zero bias gradients
        assert not np.any(np.asarray(grads[4][1], np.float32))
        assert not np.any(np.asarray(grads[5][1], np.float32))


def test_expert_biases_with_a_plan_that_dropped_every_row():
    logits, x, w1, w2, cot = make_inputs(2, 16, 64, 64, 4)
    plan = pm.routing.token_rounding_plan(logits, 1, tile=64, rounding="down")
    assert int(plan.num_rows) == 0
    b1 = jnp.ones((4, 128), jnp.bfloat16)
    b2 = jnp.ones((4, 64), jnp.bfloat16)

    def loss(x, w1, w2, scores, b1, b2):
        out = pm.moe_ffn(x, plan.with_scores(scores), w1, w2, b_gate_up=b1, b_down=b2,
                         activation=CLAMPED, backend="interpret")
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)(
        x, w1, w2, plan.scores, b1, b2)
    assert not np.any(np.asarray(out, np.float32))
    for g in grads:
        assert not np.any(np.asarray(g, np.float32)), "an empty plan must give exactly zero gradients"


# CI time (an opt-in extra): each bias alone on the kernels is in the biases-and-clamped test, none
# everywhere else
@pytest.mark.slow
def test_only_one_expert_bias_on_the_kernels():
    """b_gate_up alone and b_down alone: the missing bias gets no cotangent, the other one
    matches xla."""
    logits, x, w1, w2, cot = make_inputs(5, 16, 64, 64, 2)
    plan = pm.routing.topk_plan(logits, 1)
    b1 = (0.5 * jax.random.normal(jax.random.key(6), (2, 128))).astype(jnp.bfloat16)
    b2 = (0.5 * jax.random.normal(jax.random.key(7), (2, 64))).astype(jnp.bfloat16)
    for biases in ({"b_gate_up": b1}, {"b_down": b2}):
        def loss(backend, w1, bias):
            (name,) = biases
            out = pm.moe_ffn(x, plan, w1, w2, backend=backend, **{name: bias})
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

        (bias,) = biases.values()
        got = jax.jit(jax.grad(functools.partial(loss, "interpret"), argnums=(0, 1)))(w1, bias)
        ref = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1))(w1, bias)
        for g, r in zip(got, ref):
            assert rel_err(g, r) < 2e-2, list(biases)



@pytest.mark.parametrize(
    "shape",
    # (T, d, n, E, K): gpt-oss widths (d = n = 2880, not multiples of 128) and the 7B shape;
    # T is small (lowering cost does not depend on it).
    [(1024, 2880, 2880, 32, 4), (2048, 1536, 256, 128, 8)],
    ids=["gpt_oss", "7b"],
)
def test_expert_biases_and_clamped_swiglu_lower_for_cuda_at_production_blocks(shape):
    """Forward and every gradient of `moe_ffn(backend="mosaic")` with both expert biases and
    the clamped SwiGLU lower for an H100 at the default (production) block sizes."""
    from tests.cuda_target import h100_target

    t, d, n, e, k = shape
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    plan = jax.eval_shape(lambda l: pm.routing.topk_plan(l, k), sds((t, e), jnp.float32))

    def f(x, plan, w1, w2, b1, b2, scores):
        def loss(x, w1, w2, b1, b2, scores):
            out = pm.moe_ffn(x, plan.with_scores(scores), w1, w2, b_gate_up=b1, b_down=b2,
                             activation=pm.ops.activation.SwiGLU.clamped(), backend="mosaic")
            return jnp.sum(out.astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=tuple(range(6)))(x, w1, w2, b1, b2, scores)

    args = (sds((t, d), bf), plan, sds((e, d, 2 * n), bf), sds((e, n, d), bf), sds((e, 2 * n), bf),
            sds((e, d), bf), sds((t * k,), jnp.float32))
    with h100_target():
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "moe_up_proj" in text and "moe_down_proj" in text and "moe_dh" in text
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



def test_schedule_kernel_feeds_both_passes(monkeypatch):
    """`ForwardConfig.schedule_impl="kernel"` through the op: the forward's tiles come from
    the schedule kernel (`moe_forward_schedules`, interpreted under the interpret backend),
    and the backward's tiles of the same block sizes reuse them (no jnp `tile_meta` or
    `aligned_tile_meta` at all with these configs); its K-blocks stay jnp."""
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig

    calls = []
    for name in ("tile_meta", "aligned_tile_meta"):
        original = getattr(_common, name)
        monkeypatch.setattr(_common, name, lambda *a, _f=original, _n=name, **kw: calls.append(
            (_n, a[-1])) or _f(*a, **kw))
    logits, x, w1, w2, cot = make_inputs(0, 40, 64, 64, 4)
    plan = pm.routing.topk_plan(logits, 2)
    forward = ForwardConfig.for_shape(64, 64, num_sms=4, schedule_impl="kernel")
    backward = BackwardConfig.for_shape(64, 64, num_sms=4)
    assert (forward.up.tile_rows, forward.down.tile_rows) == (backward.dh.tile_rows, backward.dx.tile_rows)
    config = pm.kernels.KernelConfig(forward=forward, backward=backward)

    def loss(x, w1, w2):
        out = pm.moe_ffn(x, plan, w1, w2, backend="interpret", config=config)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2))
    assert "name=moe_forward_schedules" in text and calls == []

@pytest.mark.parametrize("cluster_m", [1, 2])
def test_persistent_split_m_schedules_trace(monkeypatch, cluster_m):
    """The op's forward and backward trace with 128-row up-proj tiles (the H200's persistent
    split-M kernel above d = 1536) beside dH's 64-row tiles: each block size's row tiles
    are derived once per plan and handed to its kernel. With `cluster_m=2` the up-proj's
    tiles are a cluster item's 256 rows (`UpProjConfig.tile_rows`)."""
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.up_proj import UpProjConfig

    logits, x, w1, w2, cot = make_inputs(0, 40, 64, 64, 4)
    plan = pm.routing.topk_plan(logits, 2)
    up = UpProjConfig(block_m=128, block_n=64, num_stages=3, num_consumers=2, pingpong_ctas=4,
                      cluster_m=cluster_m)
    forward = dataclasses.replace(ForwardConfig.for_shape(64, 64, num_sms=3), up=up)
    backward = BackwardConfig.for_shape(64, 64, num_sms=3)
    config = pm.kernels.KernelConfig(forward=forward, backward=backward)
    blocks = []
    original = _common.tile_meta

    def loss(x, w1, w2):
        out = pm.moe_ffn(x, plan, w1, w2, backend="interpret", config=config)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

    monkeypatch.setattr(_common, "tile_meta",
                        lambda *a, **kw: blocks.append(a[-1]) or original(*a, **kw))
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
    assert sorted(blocks) == sorted({128 * cluster_m, backward.dh.block_m}), blocks


def test_precomputed_schedules_must_match_the_config():
    from pallas_moe.kernels._common import aligned_tile_meta
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
    # dX~'s grouped GEMM takes only 128-row items (session 64): its metadata made for 64.
    stale = dataclasses.replace(plan_schedules(plan, forward, backward), dx=aligned_tile_meta(
        plan.group_sizes, plan.capacity, other(backward.dx.block_m)))
    with pytest.raises(ValueError, match="schedules.dx was computed for block_m=64"):
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
