"""The fast top-K routing paths against the dense reference, row for row.

`topk_plan(impl=...)`: "dense" is the original O(T*E) formulation and the reference here;
"sort" is the O(T*K) jnp path (the CPU default); "interpret" runs the Pallas routing kernels
(`routing/kernels.py`, the GPU default) in interpret mode. All must give the same plan
(every field bitwise, scores included) and bitwise the same gradient to the logits, across
shapes, ties, skew, biases, grouped top-K, E = 1 and K = 1, and T not a multiple of the
kernel's token block. The real kernels are checked on the GPU by
`tests/test_gpu.py` and lowered for cuda here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_moe as pm
from pallas_moe.routing import kernels
from tests.cuda_target import h100_target

EXACT_FIELDS = ("token_ids", "group_sizes", "is_token_choice", "rows_by_token", "token_row_offsets")
# Few shapes, so jitted programs are reused across hypothesis examples.
SHAPES = [(1, 1, 1), (7, 5, 2), (9, 8, 8), (33, 12, 3), (40, 64, 6), (13, 130, 4)]


@functools.partial(jax.jit, static_argnames=("k", "impl", "score", "renormalize", "groups"))
def plan_and_grad(logits, bias, weights, *, k, impl, score, renormalize, groups):
    """impl "interpret_small": the kernels interpreted, small batches in one program
    (`kernels.small_batch_routing`)."""
    num_groups, topk_groups = groups if groups else (None, None)
    small = impl == "interpret_small"

    def f(logits):
        with kernels.small_batch_routing(kernels.SMALL_BATCH_TOKENS if small else 0):
            plan = pm.routing.topk_plan(
                logits, k, score=score, renormalize=renormalize, bias=bias,
                impl="interpret" if small else impl, num_groups=num_groups,
                topk_groups=topk_groups, check_finite=False,
            )
        return jnp.sum(plan.scores * weights), plan

    (_, plan), grad = jax.value_and_grad(f, has_aux=True)(logits)
    return plan, grad


def assert_same_plan(got, want, got_grad, want_grad):
    """Every field bitwise, scores and the gradient to the logits included."""
    for field in EXACT_FIELDS + ("scores",):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    np.testing.assert_array_equal(got_grad, want_grad, err_msg="gradient to the logits")


@st.composite
def case(draw):
    T, E, K = draw(st.sampled_from(SHAPES))
    k = draw(st.integers(1, K))
    score = draw(st.sampled_from(["softmax_topk", "topk_softmax", "sigmoid"]))
    renormalize = draw(st.booleans()) and score != "topk_softmax"
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    logits = rng.normal(size=(T, E)).astype(np.float32)
    if draw(st.booleans()):  # ties: coarse logits, and equal rows
        logits = np.round(logits * 2) / 2
        logits[: T // 2] = logits[0]
    logits[:, : max(1, E // 4)] += draw(st.sampled_from([0.0, 3.0]))  # skew
    bias = rng.normal(size=(E,)).astype(np.float32) * 0.1 if score == "sigmoid" and draw(st.booleans()) else None
    groups = None
    if E in (8, 12, 64) and draw(st.booleans()):
        num_groups = {8: 4, 12: 3, 64: 8}[E]
        topk_groups = draw(st.integers(1, num_groups))
        if k <= topk_groups * (E // num_groups):
            groups = (num_groups, topk_groups)
    return logits, bias, k, score, renormalize, groups


@settings(deadline=None)  # the profile's examples (30 in CI; HYPOTHESIS_MAX_EXAMPLES for more)
@given(case(), st.sampled_from(["sort", "interpret", "interpret_small"]))
def test_fast_impls_equal_dense(c, impl):
    logits, bias, k, score, renormalize, groups = c
    weights = jnp.arange(logits.shape[0] * k, dtype=jnp.float32) % 7 - 3.0
    kw = dict(k=k, score=score, renormalize=renormalize, groups=groups)
    want, want_grad = plan_and_grad(logits, bias, weights, impl="dense", **kw)
    got, got_grad = plan_and_grad(logits, bias, weights, impl=impl, **kw)
    assert_same_plan(got, want, got_grad, want_grad)


@pytest.mark.parametrize("impl", ["sort", "interpret"])
def test_total_order_ties_like_lax_top_k(impl):
    """-0.0 < +0.0 and NaN above everything, as `jax.lax.top_k` ranks (unchecked logits)."""
    logits = jnp.array([[-0.0, 0.0, -0.0, 1e-45], [jnp.nan, 1.0, jnp.inf, 2.0], [3.0] * 4])
    want, _ = plan_and_grad(logits, None, jnp.ones(6), k=2, impl="dense", score="topk_softmax",
                            renormalize=False, groups=None)
    got, _ = plan_and_grad(logits, None, jnp.ones(6), k=2, impl=impl, score="topk_softmax",
                           renormalize=False, groups=None)
    for field in EXACT_FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


@pytest.mark.parametrize("impl", ["sort", "interpret"])
def test_probability_ties_are_not_logit_ties(impl):
    """softmax_topk ranks the probabilities, not the logits: distinct logits can round to
    equal probabilities (exp(-1e-8) is 1.0 in f32), which then tie and go to the lower
    expert, where ranking the logits would pick the higher one. Why the routing kernel
    ranks XLA's probabilities instead of the raw logits (`routing/kernels.py`)."""
    logits = jnp.array([[0.0, 1e-8, -3.0, -4.0]], jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    assert probs[0, 0] == probs[0, 1] and int(jax.lax.top_k(logits, 1)[1][0, 0]) == 1
    for want_impl in ("dense", impl):
        plan = pm.routing.topk_plan(logits, 1, score="softmax_topk", impl=want_impl)
        np.testing.assert_array_equal(plan.group_sizes, [1, 0, 0, 0], err_msg=want_impl)


def test_topk_blocks_outputs():
    """Each token's experts ascending; local ranks and block histograms add up."""
    T, E, K = 37, 12, 3
    sel = jax.random.normal(jax.random.key(0), (T, E))
    experts, local_rank, counts = kernels.topk_blocks(sel, K, interpret=True, block_t=8)
    top = np.sort(np.asarray(jax.lax.top_k(sel, K)[1]), axis=1)
    np.testing.assert_array_equal(experts, top)
    ex = np.asarray(experts)
    for t in range(T):
        b0 = t // 8 * 8
        for j in range(K):
            earlier = np.sum(ex[b0:t] == ex[t, j])
            assert local_rank[t, j] == earlier
    np.testing.assert_array_equal(
        np.asarray(counts).sum(0), np.bincount(ex.ravel(), minlength=E)
    )
    assert counts.shape == (5, E)


@pytest.mark.parametrize("shape", [(32768, 128, 8), (16384, 512, 10), (64, 60, 4), (24576, 256, 16),
                                   (1, 128, 8), (32, 256, 16)])
def test_routing_kernels_lower_for_cuda(shape):
    """The Triton lowering at production sizes (an abstract H100 stands in for the device);
    the small batches through `topk_small` (`kernels.small_batch_routing`), whose plan
    needs no XLA scatter (the scores are gathered through the program's pair ids) and no
    iota (the program writes the offsets): at decode sizes every XLA op is a launch."""
    T, E, K = shape
    f = jax.jit(lambda l: pm.routing.topk_plan(l, K, impl="kernel"))
    with h100_target(), kernels.small_batch_routing():
        text = f.trace(jax.ShapeDtypeStruct((T, E), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
    small = T <= kernels.SMALL_BATCH_TOKENS
    assert ("moe_topk_small" in text) == small
    if small:
        assert "stablehlo.scatter" not in text and "stablehlo.iota" not in text


def test_impl_argument_errors():
    with pytest.raises(ValueError, match="impl must be one of"):
        pm.routing.topk_plan(jnp.zeros((4, 3)), 1, impl="fast")


def test_auto_is_sort_on_cpu():
    from pallas_moe.routing.topk import resolve_topk_impl

    assert resolve_topk_impl("auto") == ("kernel" if jax.default_backend() == "gpu" else "sort")


@pytest.mark.parametrize("shape", [(70, 130, 4), pytest.param((300, 12, 3), marks=pytest.mark.slow)])
def test_kernel_plan_across_place_spans(shape):
    """Enough tokens for several spans of `kernels.PLACE_SPAN_BLOCKS` top-K blocks (and a
    partial last one), skewed: the interpret kernels' plan equals the dense one."""
    T, E, K = shape
    logits = jax.random.normal(jax.random.key(T), (T, E)).at[:, :3].add(2.0)
    weights = jnp.arange(T * K, dtype=jnp.float32) % 7 - 3.0
    kw = dict(k=K, score="softmax_topk", renormalize=False, groups=None)
    want, want_grad = plan_and_grad(logits, None, weights, impl="dense", **kw)
    got, got_grad = plan_and_grad(logits, None, weights, impl="interpret", **kw)
    assert T > kernels.block_tokens(E) * kernels.PLACE_SPAN_BLOCKS
    assert_same_plan(got, want, got_grad, want_grad)


@pytest.mark.parametrize("num_tokens", [32, 33])
def test_small_batches_route_in_one_program(num_tokens):
    """Up to `kernels.SMALL_BATCH_TOKENS` tokens the kernel path is one program
    (`topk_small`), past it the block path; both give the dense plan at the boundary
    (Qwen3's E = 128, K = 8, with tied rows and a skew)."""
    logits = jax.random.normal(jax.random.key(num_tokens), (num_tokens, 128))
    logits = jnp.round(logits * 2) / 2  # ties between experts
    logits = logits.at[:4].set(logits[0]).at[:, :8].add(1.0)
    weights = jnp.arange(num_tokens * 8, dtype=jnp.float32) % 5 - 2.0
    kw = dict(k=8, score="softmax_topk", renormalize=True, groups=None)
    want, want_grad = plan_and_grad(logits, None, weights, impl="dense", **kw)
    got, got_grad = plan_and_grad(logits, None, weights, impl="interpret_small", **kw)
    assert_same_plan(got, want, got_grad, want_grad)
    with kernels.small_batch_routing():
        names = str(jax.make_jaxpr(lambda l: pm.routing.topk_plan(l, 8, impl="interpret"))(logits))
    small = num_tokens <= kernels.SMALL_BATCH_TOKENS
    # By default only up to `SMALL_BATCH_DEFAULT` (8) tokens: the block path here.
    default = str(jax.make_jaxpr(lambda l: pm.routing.topk_plan(l, 8, impl="interpret"))(logits))
    assert "moe_topk_small" not in default and "moe_topk_blocks" in default
    assert ("moe_topk_small" in names) == small
    assert ("moe_topk_blocks" in names) == (not small) and ("moe_place_pairs" in names) == (not small)


# CI time: one token takes the same one-program path as 8 ([1] is a slow extra), and
# test_fast_impls_equal_dense routes single tokens.
@pytest.mark.parametrize("num_tokens", [pytest.param(1, marks=pytest.mark.slow), 8, 9])
def test_small_batches_take_one_program_by_default(num_tokens):
    """Outside `small_batch_routing`, batches of at most `SMALL_BATCH_DEFAULT` tokens (where
    it measured faster on an H200) take `topk_small`, larger ones the block path; the plan
    and its gradient are the dense reference's either way."""
    assert kernels.small_batch_limit() == kernels.SMALL_BATCH_DEFAULT == 8
    logits = jax.random.normal(jax.random.key(num_tokens), (num_tokens, 128)).at[:, :4].add(1.0)
    names = str(jax.make_jaxpr(lambda l: pm.routing.topk_plan(l, 8, impl="interpret"))(logits))
    small = num_tokens <= kernels.SMALL_BATCH_DEFAULT
    assert ("moe_topk_small" in names) == small and ("moe_topk_blocks" in names) == (not small)

    def loss(logits):
        plan = pm.routing.topk_plan(logits, 8, impl="interpret")
        return jnp.sum(plan.scores * jnp.arange(plan.scores.shape[0])), plan

    def want_loss(logits):
        plan = pm.routing.topk_plan(logits, 8, impl="dense")
        return jnp.sum(plan.scores * jnp.arange(plan.scores.shape[0])), plan

    (_, got), got_grad = jax.value_and_grad(loss, has_aux=True)(logits)
    (_, want), want_grad = jax.value_and_grad(want_loss, has_aux=True)(logits)
    assert_same_plan(got, want, got_grad, want_grad)


def test_topk_small_rejects_large_batches():
    with pytest.raises(ValueError, match="at most 32 tokens"):
        kernels.topk_small(jnp.zeros((33, 8)), 2, interpret=True)
    with pytest.raises(ValueError, match="max_tokens must be an int in \\[0, 32\\]"):
        with kernels.small_batch_routing(33):
            pass
