"""`routing.formulas`: the router's score formulas compute one order of operations, whatever
program they are compiled in, and every routing implementation computes its scores and
gradients with them (no reduction whose order XLA picks per fusion).

On the H100 the dense token-rounding plan and the kernel path once got scores one ulp apart
at E=60: `jax.nn.softmax`'s row sum was compiled in a different order in the two programs.
XLA:CPU happens to compile both alike, so these tests check the cause instead: the
probabilities equal an explicit-order numpy reference bitwise (a library reduction's order
fails that), alone and inside other programs, and no float reduction is left in any
implementation's scores or gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe as pm
from pallas_moe.routing import formulas


def pairwise_sum(columns: list[np.ndarray]) -> np.ndarray:
    """The order `formulas.tree_sum` promises, in numpy float32: pairs (i, i + n//2), the odd
    last column carried, until one is left."""
    while len(columns) > 1:
        half = len(columns) // 2
        paired = [np.float32(columns[i] + columns[half + i]) for i in range(half)]
        columns = paired + columns[2 * half:]
    return columns[0]


def reference_softmax(logits: np.ndarray) -> np.ndarray:
    """f32[T, E] softmax in the explicit order; `exp` is XLA's (an elementwise op: the same
    in any program), the row sum, the reciprocal and the products numpy's IEEE float32 ones."""
    shifted = logits - logits.max(axis=1, keepdims=True)  # the max is exact in any order
    unnormalized = np.asarray(jnp.exp(jnp.asarray(shifted)))
    total = pairwise_sum([unnormalized[:, j] for j in range(logits.shape[1])])
    return unnormalized * (np.float32(1.0) / total)[:, None]


def test_tree_sum_is_the_pairwise_order():
    x = np.random.default_rng(0).normal(size=(5, 13)).astype(np.float32) * 1e3
    want = pairwise_sum([x[:, j] for j in range(13)])[:, None]
    np.testing.assert_array_equal(jax.jit(formulas.tree_sum)(x), want)
    np.testing.assert_array_equal(formulas.tree_sum(jnp.asarray(x)), want)
    np.testing.assert_array_equal(formulas.tree_max(jnp.asarray(x)), x.max(axis=1, keepdims=True))
    np.testing.assert_array_equal(formulas.broadcast_row(jnp.asarray(want), 13), np.repeat(want, 13, 1))


@pytest.mark.parametrize("num_experts", [60, 128])
def test_probabilities_equal_the_explicit_order_in_any_program(num_experts):
    """Bitwise the numpy reference: eager, jitted alone, and jitted with consumers that XLA
    fuses with them the way the routers read them (a top-K gather, a select, a scale).
    The sigmoid's selection bias is fused in too (its last op, a division, cannot turn
    into a fused multiply-add with it)."""
    rng = np.random.default_rng(num_experts)
    logits = (rng.normal(size=(1000, num_experts)) * 3).astype(np.float32)
    want = reference_softmax(logits)
    probs = functools.partial(pm.routing.router_probabilities, score="softmax_topk")
    np.testing.assert_array_equal(probs(logits), want, err_msg="eager")
    np.testing.assert_array_equal(jax.jit(probs)(logits), want, err_msg="jitted alone")
    experts = np.asarray(jax.lax.top_k(logits, 4)[1])

    def consumers(l):
        p = probs(l)
        return jnp.take_along_axis(p, experts, 1), jnp.where(l > 0, p, -1.0), p * 2.0

    gathered, selected, scaled = jax.jit(consumers)(logits)
    np.testing.assert_array_equal(gathered, np.take_along_axis(want, experts, 1), err_msg="gather")
    np.testing.assert_array_equal(selected, np.where(logits > 0, want, -1.0), err_msg="select")
    np.testing.assert_array_equal(scaled, want * 2.0, err_msg="scale")
    bias = (rng.normal(size=(num_experts,)) * 0.1).astype(np.float32)
    sigmoid = jax.jit(functools.partial(pm.routing.router_probabilities, score="sigmoid"))(logits)
    biased = jax.jit(lambda l: pm.routing.router_probabilities(l, "sigmoid") + bias)(logits)
    np.testing.assert_array_equal(biased, sigmoid + bias, err_msg="sigmoid + bias")


def test_formulas_match_jax_nn_and_differentiate():
    """Values, reverse- and forward-mode derivatives agree with `jax.nn` (to rounding)."""
    x = jax.random.normal(jax.random.key(0), (9, 13)) * 3
    w = jax.random.normal(jax.random.key(1), x.shape)

    @jax.jit
    def value_grad_tangent(x, w):
        return [(f(x), jax.grad(lambda x, f=f: jnp.sum(f(x) * w))(x), jax.jvp(f, (x,), (w,))[1])
                for f in (formulas.softmax, formulas.log_softmax, formulas.sigmoid,
                          formulas.log_sigmoid, jax.nn.softmax, jax.nn.log_softmax,
                          jax.nn.sigmoid, jax.nn.log_sigmoid)]

    results = value_grad_tangent(x, w)
    for mine, theirs in zip(results[:4], results[4:]):
        np.testing.assert_allclose(mine[0], theirs[0], rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(mine[1], theirs[1], rtol=1e-5, atol=1e-6)  # gradients
        np.testing.assert_allclose(mine[2], theirs[2], rtol=1e-5, atol=1e-6)  # tangents
    np.testing.assert_array_equal(formulas.softmax(jnp.array([[3.0]])), [[1.0]])  # E = 1
    np.testing.assert_array_equal(
        formulas.softmax(jnp.array([[-jnp.inf, 0.0, 0.0]])), [[0.0, 0.5, 0.5]])


# Float primitives whose result depends on an order of operations XLA chooses per fusion.
FLOAT_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "cumsum",
                    "cumprod", "cummax", "cummin", "cumlogsumexp", "dot_general", "argmax",
                    "argmin", "reduce_precision"}


def float_reductions(closed_jaxpr) -> list[str]:
    """The float reductions anywhere in a jaxpr (inside calls too; a Pallas kernel is
    compiled on its own and is left out)."""
    from jax.extend import core

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                continue
            floats = any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars
                         if hasattr(v, "aval"))
            if floats and eqn.primitive.name in FLOAT_REDUCTIONS:
                found.append(eqn.primitive.name)
            for value in eqn.params.values():
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(v, core.ClosedJaxpr):
                        walk(v.jaxpr)
                    elif isinstance(v, core.Jaxpr):
                        walk(v)

    walk(closed_jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("score, renormalize", [
    ("softmax_topk", True),  # softmax over E (selection, added rows), log-softmax, softmax over K
    ("sigmoid", True),  # sigmoid, log-sigmoid, softmax over K
    pytest.param("softmax_topk", False, marks=pytest.mark.slow),
    pytest.param("topk_softmax", False, marks=pytest.mark.slow),
])
def test_no_float_reduction_in_scores_or_gradients(score, renormalize):
    """No implementation's plan, nor the backward pass of its scores to the logits, holds
    a float reduction (the old `jax.nn.softmax` did: its row sum). Grouped top-K included."""
    T, E, K = 16, 60, 4
    logits = jax.ShapeDtypeStruct((T, E), jnp.float32)
    bias = jnp.linspace(-0.1, 0.1, E) if score == "sigmoid" else None
    options = dict(score=score, renormalize=renormalize, bias=bias, check_finite=False,
                   num_groups=6, topk_groups=3)
    builds = {
        f"topk_{impl}": functools.partial(pm.routing.topk_plan, k=K, impl=impl, **options)
        for impl in ("dense", "sort", "interpret")
    } | {
        f"tr_{impl}": functools.partial(pm.routing.token_rounding_plan, k=K, tile=8, impl=impl,
                                        **options)
        for impl in ("dense", "sort", "interpret")
    }
    for name, build in builds.items():
        forward = jax.make_jaxpr(lambda l, b=build: b(l))(logits)
        assert float_reductions(forward) == [], name

        def backward(l, ct, b=build):
            return jax.vjp(lambda l: b(l).scores, l)[1](ct)

        capacity = jax.eval_shape(build, logits).capacity  # a static shape: no need to run the plan
        jaxpr = jax.make_jaxpr(backward)(logits, jax.ShapeDtypeStruct((capacity,), jnp.float32))
        assert float_reductions(jaxpr) == [], name


def test_softmax_kernel_interpret_and_cuda_lowering():
    """The GPU's softmax kernel (`kernels.softmax_rows`) in interpret mode against
    `jax.nn.softmax` (rows not a multiple of the block, E not a power of two, -inf logits),
    and its Triton lowering at production sizes (an abstract H100 stands in for the device)."""
    from pallas_moe.routing import kernels
    from tests.cuda_target import h100_target

    for shape in [(37, 60), (5, 1), (9, 3)]:
        x = jax.random.normal(jax.random.key(0), shape) * 3
        x = x.at[3, : shape[1] - 1].set(-jnp.inf)
        got = kernels.softmax_rows(x, interpret=True)
        np.testing.assert_allclose(got, jax.nn.softmax(x, axis=-1), rtol=2e-6, atol=1e-9)
    for shape in [(32768, 128), (16384, 512), (1000, 60), (64, 8), (7, 1), (1000, 3)]:
        with h100_target():
            jax.jit(kernels.softmax_rows).trace(
                jax.ShapeDtypeStruct(shape, jnp.float32)).lower(lowering_platforms=("cuda",))


def test_gpu_softmax_branch_in_interpret_mode(monkeypatch):
    """The GPU's branch (the Pallas softmax kernel as the primal of the custom JVP), run on
    the CPU in interpret mode: token-rounding plans and jitted gradients to the logits of
    the dense path and the kernel path are bitwise equal, and close to the CPU formulas'."""
    from pallas_moe.routing import kernels

    T, E, K = 40, 12, 3
    logits = jax.random.normal(jax.random.key(3), (T, E)).at[:, :3].add(1.0)
    weights = jnp.arange(T * K + E * 8, dtype=jnp.float32) % 7 - 3.0

    def plan_and_grad(logits, impl):
        def f(logits):
            plan = pm.routing.token_rounding_plan(logits, K, tile=8, impl=impl, renormalize=True)
            return jnp.sum(plan.scores * weights), plan
        (_, plan), grad = jax.value_and_grad(f, has_aux=True)(logits)
        return plan, grad

    # A jit of a fresh partial each time: jit caches its trace by the function object.
    cpu_plan, cpu_grad = jax.jit(functools.partial(plan_and_grad, impl="dense"))(logits)
    monkeypatch.setattr(formulas, "_on_gpu", lambda: True)
    monkeypatch.setattr(kernels, "softmax_rows",
                        functools.partial(kernels.softmax_rows, interpret=True))
    run = jax.jit(functools.partial(plan_and_grad), static_argnames="impl")
    assert "moe_router_softmax" in str(jax.make_jaxpr(functools.partial(plan_and_grad, impl="dense"))(logits))
    want, want_grad = run(logits, impl="dense")
    got, got_grad = run(logits, impl="interpret")
    for field in ("token_ids", "scores", "group_sizes", "is_token_choice", "rows_by_token",
                  "token_row_offsets"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    np.testing.assert_array_equal(got_grad, want_grad)
    np.testing.assert_array_equal(want.token_ids, cpu_plan.token_ids)
    np.testing.assert_allclose(want.scores, cpu_plan.scores, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(want_grad, cpu_grad, rtol=1e-4, atol=1e-6)


def test_gpu_plans_and_gradients_lower_for_cuda(monkeypatch):
    """The whole GPU program, the softmax kernel branch included: a token-rounding plan and
    its gradient to the logits (renormalized: log-softmax, softmax over the K) lower for an
    abstract H100."""
    from tests.cuda_target import h100_target

    monkeypatch.setattr(formulas, "_on_gpu", lambda: True)
    T, E, K = 16384, 512, 10

    def loss(logits):
        plan = pm.routing.token_rounding_plan(logits, K, impl="kernel", renormalize=True)
        return jnp.sum(plan.scores)

    with h100_target():
        jax.jit(jax.grad(loss)).trace(jax.ShapeDtypeStruct((T, E), jnp.float32)).lower(
            lowering_platforms=("cuda",))
