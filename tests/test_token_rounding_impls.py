"""The fast token-rounding paths against the dense reference, bitwise.

`token_rounding_plan(impl=...)`: "dense" is the original O(T*E log T) formulation (two sorts
over [T, E]) and the reference here; "sort" and "interpret" start from the fast top-K pairs
(`topk_pairs`, jnp or the Pallas routing kernels in interpret mode) and change each expert by
less than a tile. Every field of the plan and the gradient to the logits must be bitwise
equal, for every rounding mode, score order, bias, renormalization and grouped top-K, with
ties (equal logits, probabilities that underflow to 0), skew, E = 1, K = 1, tiles larger
than T (the clamped upper option) and both selection levels (`chunk`).

Most cases run eagerly: op-by-op programs are cached across shapes and options, where a
jitted plan compiles afresh for every static option (seconds each on a CPU). Under `jit`
(a few cases, and the module's `nn.functional.route`) plans and gradients are bitwise
equal too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pallas_moe as pm
from pallas_moe.routing import token_rounding as tr
from tests.cuda_target import h100_target

FIELDS = ("token_ids", "scores", "group_sizes", "is_token_choice", "rows_by_token", "token_row_offsets")
# (T, E, k, tile, chunk): few geometries, so eager programs are reused across examples.
GEOMETRIES = [
    (7, 5, 2, 4, 3),  # two levels, chunks of 3 tokens (T not a multiple)
    (9, 8, 8, 4, None),  # K = E: no candidate to add
    (40, 12, 3, 4, None),  # two levels, chunks of selection_chunk(40, 3) = 4 tokens
]
# The slow sweep adds (E = 1, K = 1 and the clamped upper option are also checked by
# `test_clamped_upper_option_and_single_expert`):
SWEEP_GEOMETRIES = GEOMETRIES + [
    (5, 1, 1, 4, None),  # E = 1, K = 1: every token is the expert's; rounding down drops 1
    (7, 5, 1, 16, None),  # tile > T: the upper option is clamped to T; one level
    (40, 12, 3, 16, 1),  # one level
    (40, 12, 1, 1, None),  # tile 1: nothing to change
    (40, 8, 2, 8, None),
    (130, 16, 4, 16, 2),
    (300, 8, 2, 8, None),  # selection_chunk(300, 7) = 8
]
GROUPS = {8: (4, 2), 12: (3, 2), 16: (4, 3)}  # num_groups and the largest topk_groups tried


def plan_and_grad(logits, k, *, impl, chunk=None, **options):
    """(plan, d sum(scores * w) / d logits) for one implementation."""
    capacity = logits.shape[0] * k + logits.shape[1] * options["tile"]
    weights = jnp.arange(capacity, dtype=jnp.float32) % 7 - 3.0

    def f(logits):
        if chunk is None:
            plan = pm.routing.token_rounding_plan(logits, k, impl=impl, check_finite=False, **options)
        else:
            plan = tr.token_rounding_plan_fast(logits, k, impl=impl, chunk=chunk, **options)[0]
        return jnp.sum(plan.scores * weights), plan

    (_, plan), grad = jax.value_and_grad(f, has_aux=True)(logits)
    return plan, grad


def assert_same_plan(got, want, got_grad, want_grad):
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    np.testing.assert_array_equal(got_grad, want_grad, err_msg="gradient to the logits")


@st.composite
def case(draw, geometries=GEOMETRIES):
    T, E, k, tile, chunk = draw(st.sampled_from(geometries))
    score = draw(st.sampled_from(["softmax_topk", "topk_softmax", "sigmoid"]))
    options = dict(
        tile=tile,
        rounding=draw(st.sampled_from(tr.ROUNDING_MODES)),
        key=jax.random.key(draw(st.integers(0, 7))),
        score=score,
        renormalize=draw(st.booleans()) and score != "topk_softmax",
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    logits = rng.normal(size=(T, E)).astype(np.float32)
    if draw(st.booleans()):  # ties: coarse logits, and equal rows
        logits = np.round(logits * 2) / 2
        logits[: T // 2] = logits[0]
    if draw(st.booleans()):  # probabilities that underflow to exactly 0 (sigmoid and softmax)
        logits[rng.random(size=(T, E)) < 0.3] = -200.0
    logits[:, : max(1, E // 4)] += draw(st.sampled_from([0.0, 3.0]))  # skew
    if score == "sigmoid" and draw(st.booleans()):
        options["bias"] = jnp.asarray(rng.normal(size=(E,)).astype(np.float32) * 0.1)
    if E in GROUPS and draw(st.booleans()):
        num_groups, most = GROUPS[E]
        topk_groups = draw(st.integers(1, most))
        if k <= topk_groups * (E // num_groups):
            options.update(num_groups=num_groups, topk_groups=topk_groups)
    return jnp.asarray(logits), k, chunk, options


@pytest.mark.slow  # CI time; the sort path is the fallback (`impl="sort"`), and the slow sweep
@settings(max_examples=12, deadline=None)  # below covers it with 150 examples
@given(case())
def test_sort_impl_equals_dense(c):
    """Eager, every option."""
    logits, k, chunk, options = c
    want, want_grad = plan_and_grad(logits, k, impl="dense", **options)
    got, got_grad = plan_and_grad(logits, k, impl="sort", chunk=chunk, **options)
    assert_same_plan(got, want, got_grad, want_grad)


@pytest.mark.slow  # CI time (~55 s): the interpreted kernels stay covered in CI by
# test_fast_equals_dense_under_jit[interpret-...], test_select_largest_matches_numpy and
# test_tokens_per_expert_by_kernel_matches_numpy, and on
# the H100 by tests/test_gpu.py's plan equality tests (every rounding and score mode).
@settings(max_examples=6, deadline=None)
@given(case())
def test_kernel_impl_equals_dense(c):
    """The Pallas selection kernel (`kernels.select_largest`, interpret mode) in the fast
    path: every option, both selection levels, bitwise."""
    logits, k, chunk, options = c
    want, want_grad = plan_and_grad(logits, k, impl="dense", **options)
    got, got_grad = plan_and_grad(logits, k, impl="interpret", chunk=chunk, **options)
    assert_same_plan(got, want, got_grad, want_grad)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["sort", "interpret"])
@settings(max_examples=150, deadline=None)
@given(c=case(SWEEP_GEOMETRIES))
def test_fast_impls_equal_dense_sweep(impl, c):
    """As `test_sort_impl_equals_dense`, over more geometries and examples (minutes)."""
    logits, k, chunk, options = c
    want, want_grad = plan_and_grad(logits, k, impl="dense", **options)
    got, got_grad = plan_and_grad(logits, k, impl=impl, chunk=chunk, **options)
    assert_same_plan(got, want, got_grad, want_grad)


@pytest.mark.parametrize("impl, rounding, score", [
    ("interpret", "balance", "topk_softmax"),  # the top-K step by the Pallas kernels
    ("sort", "nearest", "softmax_topk"),  # the case whose fused backward rounded differently
    pytest.param("sort", "stochastic", "sigmoid", marks=pytest.mark.slow),
])
def test_fast_equals_dense_under_jit(impl, rounding, score):
    """Under jit the plans and the gradients to the logits are bitwise equal.

    With `jax.nn.softmax`, XLA fused each program's cotangent producer into the softmax
    backward's row reduction and the gradients differed in the last bit (softmax_topk,
    nearest); `routing.formulas` has no reduction and isolates its backward.
    """
    T, E, K, tile = 45, 12, 3, 8
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(T, E)).astype(np.float32)
    logits[: T // 3] = np.round(logits[: T // 3] * 2) / 2  # ties
    options = dict(tile=tile, rounding=rounding, key=jax.random.key(5), score=score,
                   renormalize=score == "sigmoid")
    run = jax.jit(functools.partial(plan_and_grad, k=K, **options), static_argnames="impl")
    want, want_grad = run(jnp.asarray(logits), impl="dense")
    got, got_grad = run(jnp.asarray(logits), impl=impl)
    assert_same_plan(got, want, got_grad, want_grad)


@pytest.mark.parametrize("impl, rounding, score, renormalize", [
    ("sort", "nearest", "softmax_topk", False),
    # CI time: the interpret impl under jit in test_fast_equals_dense_under_jit, rounding up
    # in test_clamped_upper_option_and_single_expert; the module route with [sort-...].
    pytest.param("interpret", "up", "sigmoid", True, marks=pytest.mark.slow),
])
def test_module_route_fast_equals_dense(impl, rounding, score, renormalize):
    """`nn.functional.route` (what `pm.nn.MoE` calls): the fast path against the dense one
    and against the dense assignment the module used before, under jit: plans, counts and
    gradients to the logits (through the scores and the aux loss) bitwise."""
    from pallas_moe.nn import functional as F

    T, E, K, tile = 45, 12, 3, 8
    cfg = F.RouterConfig(num_experts=E, top_k=K, routing="token_rounding", tile=tile,
                         rounding=rounding, score=score, renormalize=renormalize,
                         routed_scaling_factor=2.5)
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(T, E)).astype(np.float32)
    logits[: T // 3] = np.round(logits[: T // 3] * 2) / 2  # ties
    bias = jnp.asarray(rng.normal(size=(E,)).astype(np.float32) * 0.1) if score == "sigmoid" else None
    weights = jnp.arange(cfg.capacity(T), dtype=jnp.float32) % 7 - 3.0

    def assignment_route(logits):
        """The module's routing before the fast path: a dense assignment, then the plan."""
        selected, w, tc_selected = F.route_assignment(logits, cfg, bias=bias)
        plan = pm.routing.plan_from_assignment(selected, w, selected & tc_selected, cfg.capacity(T))
        return plan, F.assignment_counts(selected, tc_selected)

    def loss(logits, route):
        plan, counts = route(logits)
        aux = F.finish_aux(F.router_sums(logits, counts), cfg)
        return jnp.sum(plan.scores * weights) + aux["loss"], (plan, counts)

    results = {
        name: jax.jit(jax.grad(functools.partial(loss, route=route), has_aux=True))(jnp.asarray(logits))
        for name, route in [
            ("before", assignment_route),
            ("dense", functools.partial(F.route, cfg=cfg, bias=bias, impl="dense")),
            (impl, functools.partial(F.route, cfg=cfg, bias=bias, impl=impl)),
        ]
    }
    want_grad, (want, want_counts) = results["dense"]
    for name in ("before", impl):
        got_grad, (got, got_counts) = results[name]
        assert_same_plan(got, want, got_grad, want_grad)
        for field in ("counts", "tc_counts", "kept_tc_counts"):
            np.testing.assert_array_equal(got_counts[field], want_counts[field], err_msg=f"{name} {field}")


@pytest.mark.parametrize("rounding", [
    "up",  # the mode the clamp is about (rounding up past T)
    # CI time: the other modes are slow extras (the hypothesis tests cover them).
    pytest.param("nearest", marks=pytest.mark.slow),
    pytest.param("down", marks=pytest.mark.slow), pytest.param("balance", marks=pytest.mark.slow),
])
def test_clamped_upper_option_and_single_expert(rounding):
    """T within a tile of the count: rounding up takes every token (T is no tile multiple)."""
    logits = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    logits[:5, 0] += 10.0  # expert 0: 5 of 7 tokens; up to a tile of 4 is clamped to T = 7
    single = np.random.default_rng(1).normal(size=(5, 1)).astype(np.float32)  # E = 1, K = 1
    for case_logits, k, chunk in ((logits, 2, 3), (single, 1, None)):
        options = dict(tile=4, rounding=rounding)
        want, want_grad = plan_and_grad(jnp.asarray(case_logits), k, impl="dense", **options)
        for impl in ("sort", "interpret"):
            got, got_grad = plan_and_grad(jnp.asarray(case_logits), k, impl=impl, chunk=chunk, **options)
            assert_same_plan(got, want, got_grad, want_grad)
        if rounding == "up":
            assert int(got.group_sizes[0]) == case_logits.shape[0]


def test_zero_probability_ties_go_by_token():
    """Candidates whose probabilities underflow to 0 tie; the lowest tokens are added.

    Token 0 picks expert 2; rounding expert 2 up to 4 adds 3 of tokens 1..6, all at
    probability 0 (plus a zero bias): tokens 1, 2, 3.
    """
    logits = jnp.full((7, 5), -200.0).at[:, 0].set(5.0).at[:, 1].set(4.0).at[0, 2].set(10.0)
    for bias in (None, jnp.zeros(5)):
        options = dict(tile=4, rounding="up", score="sigmoid", bias=bias)
        want, want_grad = plan_and_grad(logits, 2, impl="dense", **options)
        for impl in ("sort", "interpret"):
            got, got_grad = plan_and_grad(logits, 2, impl=impl, chunk=3, **options)
            assert_same_plan(got, want, got_grad, want_grad)
            rows = np.asarray(got.token_ids)[np.asarray(got.expert_ids) == 2]
            np.testing.assert_array_equal(rows, [0, 1, 2, 3])


def _candidate_keys(seed, T, E):
    """(rng, keys i32 [T, E] with many ties and ~30% non-candidates (INT32_MIN), count
    i32 [E] of keys to pick (at most each expert's candidates), max_count)."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(-3, 3, size=(T, E)).astype(np.int32)  # many ties
    keys[rng.random(size=(T, E)) < 0.3] = tr._INT32_MIN  # not a candidate
    max_count = min(T, 6)
    candidates = (keys > tr._INT32_MIN).sum(0)
    count = np.minimum(rng.integers(0, max_count + 1, size=E), candidates).astype(np.int32)
    return rng, keys, count, max_count


@given(
    st.integers(0, 2**16), st.sampled_from([(1, 1), (9, 3), (40, 5)]), st.sampled_from([1, 4, 7]),
)
@settings(max_examples=20, deadline=None)
def test_top_tokens_per_expert_matches_numpy(seed, shape, chunk):
    """Each expert's `count` largest keys, ties to the lower token, in rank order, then T."""
    T, E = shape
    rng, keys, count, max_count = _candidate_keys(seed, T, E)
    got = np.asarray(tr.top_tokens_per_expert(jnp.asarray(keys), jnp.asarray(count), max_count, chunk))
    for e in range(E):
        ranked = sorted(range(T), key=lambda t: (-int(keys[t, e]), t))[: count[e]]
        np.testing.assert_array_equal(got[e], ranked + [T] * (max_count - count[e]))


@given(st.integers(0, 2**16), st.sampled_from([(1, 1), (3, 7), (4, 40), (2, 300)]),
       st.sampled_from([1, 5, 16]))
@settings(max_examples=12, deadline=None)
def test_select_largest_matches_numpy(seed, shape, max_count):
    """The selection kernel (interpret mode): each row's `count` largest keys as ascending
    indices, then L; ties at the threshold to the lower index, or the higher one where
    `prefer_high`; full-range keys, heavy ties and INT32_MIN (non-candidates) included."""
    from pallas_moe.routing import kernels

    R, L = shape
    rng = np.random.default_rng(seed)
    keys = rng.integers(-3, 3, size=(R, L)).astype(np.int32)  # many ties
    wide = rng.random(size=(R, L)) < 0.5
    keys[wide] = rng.integers(-2**31, 2**31 - 1, size=int(wide.sum()), dtype=np.int64).astype(np.int32)
    keys[rng.random(size=(R, L)) < 0.2] = tr._INT32_MIN
    count = np.minimum(rng.integers(0, max_count + 1, size=R), min(L, max_count)).astype(np.int32)
    high = rng.random(size=R) < 0.5
    got = np.asarray(kernels.select_largest(
        jnp.asarray(keys), jnp.asarray(count), jnp.asarray(high), max_count=max_count, interpret=True))
    for r in range(R):
        ranked = sorted(range(L), key=lambda i: (-int(keys[r, i]), -i if high[r] else i))[: count[r]]
        np.testing.assert_array_equal(got[r], sorted(ranked) + [L] * (max_count - count[r]))


@given(
    st.integers(0, 2**16), st.sampled_from([(1, 1), (9, 3), (40, 5)]), st.sampled_from([1, 4, 7]),
)
@settings(max_examples=10, deadline=None)
def test_tokens_per_expert_by_kernel_matches_numpy(seed, shape, chunk):
    """Both kernel levels: each expert's `count` largest keys, ascending tokens, then T."""
    T, E = shape
    rng, keys, count, max_count = _candidate_keys(seed, T, E)
    high = rng.random(size=E) < 0.5
    got = np.asarray(tr.tokens_per_expert_by_kernel(
        jnp.asarray(keys), jnp.asarray(count), jnp.asarray(high), max_count, chunk, interpret=True))
    for e in range(E):
        ranked = sorted(range(T), key=lambda t: (-int(keys[t, e]), -t if high[e] else t))[: count[e]]
        np.testing.assert_array_equal(got[e], sorted(ranked) + [T] * (max_count - count[e]))


@pytest.mark.parametrize("shape", [(128, 2048, 127), (512, 2032, 127), (128, 16384, 127), (3, 5, 2)])
def test_select_largest_lowers_for_cuda(shape):
    """The selection kernel at production list lengths lowers for an H100."""
    from pallas_moe.routing import kernels

    R, L, M = shape
    f = jax.jit(lambda k, c, h: kernels.select_largest(k, c, h, max_count=M))
    with h100_target():
        f.trace(jax.ShapeDtypeStruct((R, L), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.int32),
                jax.ShapeDtypeStruct((R,), jnp.bool_)).lower(lowering_platforms=("cuda",))


def test_select_largest_errors():
    from pallas_moe.routing import kernels

    with pytest.raises(ValueError, match="at most 16384 keys"):
        kernels.select_largest(jnp.zeros((1, 16385), jnp.int32), jnp.zeros((1,), jnp.int32),
                               jnp.zeros((1,), bool), max_count=3)


def test_selection_chunk():
    assert tr.selection_chunk(32768, 127) == 16
    assert tr.selection_chunk(4096, 127) == 8
    assert tr.selection_chunk(512, 127) == 1
    assert tr.selection_chunk(100, 0) == 1


def test_impl_argument_errors():
    with pytest.raises(ValueError, match="impl must be one of"):
        pm.routing.token_rounding_plan(jnp.zeros((4, 3)), 1, impl="fast")
    with pytest.raises(ValueError, match="num_groups and topk_groups go together"):
        pm.routing.token_rounding_plan(jnp.zeros((4, 4)), 1, num_groups=2)


@pytest.mark.parametrize("shape", [(32768, 128, 8), (16384, 512, 10)])
def test_fast_token_rounding_lowers_for_cuda(shape):
    """The kernel path at production sizes lowers for an H100 (abstract target)."""
    T, E, K = shape
    f = jax.jit(lambda l: pm.routing.token_rounding_plan(l, K, tile=128, impl="kernel"))
    with h100_target():
        f.trace(jax.ShapeDtypeStruct((T, E), jnp.float32)).lower(lowering_platforms=("cuda",))


@given(st.integers(0, 2**16), st.sampled_from([1, 5, 64, 300]))
@settings(max_examples=10, deadline=None)
def test_count_below_in_segment_matches_searchsorted(seed, max_length):
    """The branchless search: entries < value in each query's ascending segment."""
    rng = np.random.default_rng(seed)
    values = np.sort(rng.integers(-4, 4, size=2 * max_length)).astype(np.int32)  # many ties
    start = rng.integers(0, max_length + 1, size=17).astype(np.int32)
    length = rng.integers(0, max_length + 1, size=17).astype(np.int32)
    value = rng.integers(-6, 6, size=17).astype(np.int32)
    got = tr._count_below_in_segment(jnp.asarray(values), jnp.asarray(start), jnp.asarray(length),
                                     jnp.asarray(value), max_length)
    want = [np.searchsorted(values[s:s + n], v) for s, n, v in zip(start, length, value)]
    np.testing.assert_array_equal(got, want)


def test_fast_path_compiles_in_seconds_on_cpu():
    """The 16-step searches of T=32768 compile in well under a minute on XLA:CPU (the
    (low, high) formulation took 65-75 s for one search alone: `_count_below_by_search`)."""
    import time

    search = jax.jit(lambda values, start, length, value: tr._count_below_in_segment(
        values, start, length, value, 32768))
    args = (jax.ShapeDtypeStruct((32768 * 8,), jnp.int32),) + (jax.ShapeDtypeStruct((128, 127), jnp.int32),) * 3
    begin = time.perf_counter()
    search.lower(*args).compile()
    assert time.perf_counter() - begin < 20.0


def test_forward_mode_through_the_routers():
    """The score formulas are custom JVPs (`routing.formulas`): forward mode still
    differentiates the routers, and each implementation gives the reference's tangent."""
    logits = jax.random.normal(jax.random.key(0), (16, 8))
    tangent = jax.random.normal(jax.random.key(1), (16, 8))
    tangents = {}
    for impl in ("dense", "sort"):
        f = lambda l, i=impl: jnp.sum(
            pm.routing.token_rounding_plan(l, 2, tile=4, impl=i).scores * jnp.arange(16 * 2 + 8 * 4))
        tangents[impl] = jax.jvp(f, (logits,), (tangent,))[1]
    np.testing.assert_allclose(tangents["sort"], tangents["dense"], rtol=1e-6)
