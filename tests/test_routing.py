"""Routing invariants as property tests, against independent numpy references."""

import jax
import jax.numpy as jnp
from jax.experimental import checkify
import numpy as np
import pytest
from hypothesis import given, strategies as st

import pallas_moe as pm
from pallas_moe.routing import plan as plan_lib


# Shapes come from small sets so compiled programs are reused across examples (every new
# shape compiles afresh); values, k, skew and tiles still vary freely.
TOKEN_COUNTS = [1, 7, 16, 33, 48]
EXPERT_COUNTS = [1, 2, 3, 5, 8, 12]

topk_plan = jax.jit(pm.routing.topk_plan, static_argnums=1, static_argnames=("score", "renormalize"))
token_rounding_plan = jax.jit(
    pm.routing.token_rounding_plan, static_argnums=1, static_argnames=("tile", "rounding", "score")
)


@st.composite
def routing_case(draw):
    num_experts = draw(st.sampled_from(EXPERT_COUNTS))
    num_tokens = draw(st.sampled_from(TOKEN_COUNTS))
    k = draw(st.integers(1, num_experts))
    skew = draw(st.sampled_from([0.0, 0.0, 3.0, 8.0]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_tokens, num_experts)).astype(np.float32)
    # Skew: a few experts get a large bias, so they attract most tokens.
    logits[:, : max(1, num_experts // 4)] += skew
    return logits, k


def np_softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def reference_topk(logits, k, score, renormalize):
    """Independent numpy top-K: returns {(t, e): weight}."""
    num_tokens, _ = logits.shape
    probs = 1 / (1 + np.exp(-logits)) if score == "sigmoid" else np_softmax(logits)
    out = {}
    for t in range(num_tokens):
        # Ties broken by lower expert index, as lax.top_k does.
        chosen = sorted(range(logits.shape[1]), key=lambda e: (-logits[t, e], e))[:k]
        if score == "topk_softmax":
            w = np_softmax(logits[t, chosen])
        else:
            w = probs[t, chosen]
            if renormalize:
                w = w / w.sum()
        out.update({(t, e): float(wi) for e, wi in zip(chosen, w)})
    return out


def check_plan_structure(plan, num_tokens):
    """Grouped order, stability, CSR and padding invariants shared by every plan."""
    token_ids = np.asarray(plan.token_ids)
    sizes = np.asarray(plan.group_sizes)
    num_rows = int(sizes.sum())
    assert num_rows <= plan.capacity
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for e in range(plan.num_experts):
        toks = token_ids[offsets[e] : offsets[e + 1]]
        assert np.all(np.diff(toks) > 0), "rows of an expert must be sorted by token, no repeats"
    # Padding rows are inert.
    assert np.all(np.asarray(plan.scores)[num_rows:] == 0)
    assert np.all(token_ids[num_rows:] == 0)
    assert not np.any(np.asarray(plan.is_token_choice)[num_rows:])
    # CSR: each token's rows, ascending expert, and together a permutation of the real rows.
    experts = np.asarray(plan.expert_ids)
    csr = np.asarray(plan.rows_by_token)
    tro = np.asarray(plan.token_row_offsets)
    assert tro[0] == 0 and tro[-1] == num_rows and len(tro) == num_tokens + 1
    assert sorted(csr[:num_rows].tolist()) == list(range(num_rows))
    assert np.array_equal(csr[num_rows:], np.arange(num_rows, plan.capacity))
    for t in range(num_tokens):
        rows = csr[tro[t] : tro[t + 1]]
        assert np.all(token_ids[rows] == t)
        assert np.all(np.diff(experts[rows]) > 0)
    assert np.all(experts[num_rows:] == plan.num_experts)


def plan_pairs(plan):
    sizes = np.asarray(plan.group_sizes)
    n = int(sizes.sum())
    tok = np.asarray(plan.token_ids)[:n]
    exp = np.asarray(plan.expert_ids)[:n]
    sc = np.asarray(plan.scores)[:n]
    return {(int(t), int(e)): float(s) for t, e, s in zip(tok, exp, sc)}


@given(case=routing_case(), score=st.sampled_from(pm.routing.SCORE_ORDERS), renorm=st.booleans())
def test_topk_plan_is_permutation_of_assignments(case, score, renorm):
    logits, k = case
    plan = topk_plan(jnp.asarray(logits), k, score=score, renormalize=renorm)
    num_tokens = logits.shape[0]
    assert plan.capacity == num_tokens * k
    assert int(plan.num_rows) == num_tokens * k
    check_plan_structure(plan, num_tokens)
    ref = reference_topk(logits, k, score, renorm)
    got = plan_pairs(plan)
    assert got.keys() == ref.keys()
    np.testing.assert_allclose([got[p] for p in ref], [ref[p] for p in ref], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(plan.is_token_choice))
    assert np.all(np.asarray(plan.rows_per_token) == k)


def test_sigmoid_bias_moves_selection_not_weights():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
    bias = jnp.array([10.0, 0.0, 0.0, 0.0])
    plan = pm.routing.topk_plan(logits, 1, score="sigmoid", bias=bias)
    assert int(plan.group_sizes[0]) == 16  # the bias pulls every token to expert 0
    np.testing.assert_allclose(plan.scores, jax.nn.sigmoid(logits[:, 0]), rtol=1e-6)


def reference_token_rounding(logits, k, tile, rounding, score="softmax_topk"):
    """Independent numpy token rounding for deterministic modes: {(t, e): weight}, targets."""
    num_tokens, num_experts = logits.shape
    tc = reference_topk(logits, k, score, False)
    probs = np_softmax(logits) if score != "sigmoid" else 1 / (1 + np.exp(-logits))
    out, targets, deviation = {}, [], 0
    for e in range(num_experts):
        f = sum(1 for (t, ee) in tc if ee == e)
        lo, hi = (f // tile) * tile, min(-(-f // tile) * tile, num_tokens)
        if rounding == "up":
            r = hi
        elif rounding == "down":
            r = lo
        elif rounding == "nearest":
            r = hi if hi - f < f - lo else lo
        else:  # balance
            r = hi if abs(deviation + hi - f) < abs(deviation + lo - f) else lo
            deviation += r - f
        r = min(r, num_tokens)
        targets.append(r)
        ranked = sorted(range(num_tokens), key=lambda t: ((t, e) not in tc, -probs[t, e], t))
        for t in ranked[:r]:
            out[(t, e)] = tc.get((t, e), float(probs[t, e]))
    return out, np.array(targets), tc


@given(
    case=routing_case(),
    tile=st.sampled_from([1, 2, 3, 4, 8, 16]),
    rounding=st.sampled_from(["nearest", "up", "down", "balance"]),
)
def test_token_rounding_matches_reference(case, tile, rounding):
    logits, k = case
    num_tokens, num_experts = logits.shape
    plan = token_rounding_plan(jnp.asarray(logits), k, tile=tile, rounding=rounding)
    assert plan.capacity == num_tokens * k + num_experts * tile
    check_plan_structure(plan, num_tokens)
    ref, targets, tc = reference_token_rounding(logits, k, tile, rounding)
    got = plan_pairs(plan)
    assert got.keys() == ref.keys()
    np.testing.assert_allclose([got[p] for p in ref], [ref[p] for p in ref], rtol=1e-5, atol=1e-6)
    sizes = np.asarray(plan.group_sizes)
    np.testing.assert_array_equal(sizes, targets)
    tc_counts = np.bincount([e for (_, e) in tc], minlength=num_experts)
    # Rounding bounds: within one tile of TC, a tile multiple unless out of candidates.
    assert np.all(np.abs(sizes - tc_counts) < tile)
    assert np.all((sizes % tile == 0) | (sizes == num_tokens))
    if rounding == "up":
        assert np.all(sizes >= tc_counts)
    if rounding == "down":
        assert np.all(sizes <= tc_counts)
    if rounding == "balance":
        running = np.cumsum(sizes - tc_counts)
        assert np.all(np.abs(running) <= tile / 2)
    # Token-choice rows outrank added rows: an expert that added rows dropped none.
    is_tc = np.asarray(plan.is_token_choice)[: int(sizes.sum())]
    experts = np.asarray(plan.expert_ids)[: int(sizes.sum())]
    for e in range(num_experts):
        kept_tc = int(is_tc[experts == e].sum())
        added = int((~is_tc[experts == e]).sum())
        assert added == 0 or kept_tc == tc_counts[e]


@given(case=routing_case(), tile=st.sampled_from([1, 3, 4, 16]), seed=st.integers(0, 1000))
def test_stochastic_rounding_picks_a_neighbour_multiple(case, tile, seed):
    logits, k = case
    num_tokens = logits.shape[0]
    plan = token_rounding_plan(
        jnp.asarray(logits), k, tile=tile, rounding="stochastic", key=jax.random.key(seed)
    )
    check_plan_structure(plan, num_tokens)
    tc_counts = np.asarray(topk_plan(jnp.asarray(logits), k).group_sizes)
    sizes = np.asarray(plan.group_sizes)
    lo, hi = (tc_counts // tile) * tile, -(-tc_counts // tile) * tile
    assert np.all((sizes == lo) | (sizes == np.minimum(hi, num_tokens)))


def test_stochastic_rounding_is_unbiased():
    counts = jnp.array([5, 130, 64, 1, 127])
    keys = jax.random.split(jax.random.key(0), 4000)
    rounded = jax.vmap(lambda key: pm.routing.rounded_counts(counts, 64, "stochastic", max_count=10**6, key=key))(keys)
    np.testing.assert_allclose(np.mean(np.asarray(rounded), 0), counts, atol=2.5)


def test_single_expert_and_single_token():
    plan = pm.routing.topk_plan(jnp.zeros((1, 1)), 1)
    assert int(plan.num_rows) == 1 and float(plan.scores[0]) == 1.0
    tr = pm.routing.token_rounding_plan(jnp.zeros((5, 1)), 1, tile=4, rounding="up")
    # Out of candidates: clamped to T=5 rather than 8.
    assert int(tr.group_sizes[0]) == 5


def test_tile_schedule_covers_each_group():
    sizes = jnp.array([0, 5, 130, 0, 128, 1], jnp.int32)
    sched = plan_lib.tile_schedule(sizes, capacity=300, block_m=64)
    starts, ends, experts = map(np.asarray, (sched.row_start, sched.row_end, sched.expert))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    covered = []
    for s, e, x in zip(starts, ends, experts):
        assert 0 <= e - s <= 64
        if e > s:
            assert offsets[x] <= s and e <= offsets[x + 1]
            covered.extend(range(s, e))
    assert covered == list(range(int(sizes.sum())))
    real = int(((np.asarray(sizes) + 63) // 64).sum())
    assert np.all(starts[real:] == ends[real:])
    assert sched.max_tiles == 300 // 64 + 6


def test_aux_terms():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    plan = pm.routing.topk_plan(logits, 2)
    lb = pm.routing.load_balancing_loss(logits, plan, 2)
    assert 0.9 < float(lb) < 2.0
    uniform = pm.routing.topk_plan(jnp.zeros((64, 8)), 2)
    # With uniform probabilities the loss is exactly 1 whatever the counts.
    assert abs(float(pm.routing.load_balancing_loss(jnp.zeros((64, 8)), uniform, 2)) - 1) < 1e-6
    z = pm.routing.router_z_loss(logits)
    np.testing.assert_allclose(z, np.mean(np.log(np.exp(np.asarray(logits)).sum(-1)) ** 2), rtol=1e-5)
    bias = pm.routing.update_selection_bias(jnp.zeros(3), jnp.array([10, 5, 0]), 0.1)
    np.testing.assert_allclose(bias, [-0.1, 0.0, 0.1])
    tr = pm.routing.token_rounding_plan(logits, 2, tile=8, rounding="up")
    stats = pm.routing.routing_stats(tr, plan.group_sizes, tile=8)
    assert int(stats["padding_rows"]) == 0 and int(stats["dropped_rows"]) == 0
    assert int(stats["added_rows"]) == int(tr.num_rows) - 128
    assert int(stats["tc_padding_rows"]) == int(((plan.group_sizes + 7) // 8 * 8 - plan.group_sizes).sum())


def test_routing_under_jit_and_grad():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(32, 6)), jnp.float32)
    f = jax.jit(lambda l: pm.routing.token_rounding_plan(l, 2, tile=4).scores.sum())
    g = jax.grad(f)(logits)
    assert g.shape == logits.shape and bool(jnp.all(jnp.isfinite(g)))
    assert float(jnp.abs(g).sum()) > 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: pm.routing.topk_plan(jnp.zeros((4, 3)), 4), "k=4 must be <= the number of experts"),
        (lambda: pm.routing.topk_plan(jnp.zeros((4, 3)), 0), "k must be positive"),
        (lambda: pm.routing.topk_plan(jnp.zeros((4,)), 1), "logits must have 2 dimensions"),
        (lambda: pm.routing.topk_plan(jnp.zeros((4, 3), jnp.int32), 1), "logits must be a floating"),
        (lambda: pm.routing.topk_plan(jnp.zeros((4, 3)), 1, score="bogus"), "score must be one of"),
        (lambda: pm.routing.token_rounding_plan(jnp.zeros((4, 3)), 1, tile=0), "tile must be positive"),
        (lambda: pm.routing.token_rounding_plan(jnp.zeros((4, 3)), 1, rounding="x"), "rounding must be one of"),
        (lambda: pm.routing.token_rounding_plan(jnp.zeros((4, 3)), 1, rounding="stochastic"), "key must be"),
        (lambda: pm.routing.topk_plan(jnp.array([[0.0, jnp.nan]]), 1), "logits contains NaN or Inf"),
        (lambda: pm.routing.topk_plan(jnp.zeros((4, 3)), 1, bias=jnp.zeros(3)), "bias .* only used"),
        (lambda: pm.routing.topk_plan(jnp.zeros((4, 3)), 1, score="sigmoid", bias=jnp.zeros(2)), "bias must have shape"),
    ],
)
def test_bad_router_input_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("make_plan", [
    lambda l, **kw: pm.routing.topk_plan(l, 1, **kw),
    lambda l, **kw: pm.routing.token_rounding_plan(l, 1, tile=2, **kw),
])
def test_nonfinite_logits_checkify_under_jit(make_plan):
    """check_finite=True checks on device through checkify: no host callback in the step."""
    f = jax.jit(checkify.checkify(lambda l: make_plan(l, check_finite=True).scores))
    err, _ = f(jnp.array([[0.0, jnp.inf], [jnp.nan, 1.0]]))
    with pytest.raises(checkify.JaxRuntimeError, match="logits contains 2 NaN or Inf"):
        err.throw()
    err, _ = f(jnp.array([[0.0, 1.0], [2.0, 1.0]]))
    err.throw()  # finite logits pass


def test_default_jit_routing_has_no_host_callback():
    """The default jitted plan neither checks on the host nor stages a callback."""
    text = jax.jit(lambda l: pm.routing.topk_plan(l, 2).scores).lower(jnp.zeros((8, 4))).as_text()
    assert "callback" not in text.lower()
    # Unchecked, non-finite logits still give in-range plan metadata (no crash downstream).
    plan = jax.jit(lambda l: pm.routing.topk_plan(l, 2, check_finite=False))(
        jnp.array([[jnp.nan, 0.0, 1.0, 2.0]] * 8)
    )
    assert int(plan.num_rows) == 16 and bool(jnp.all(plan.token_ids < 8))


def test_check_finite_true_without_checkify_says_so():
    with pytest.raises(ValueError, match="checkify"):
        jax.jit(lambda l: pm.routing.topk_plan(l, 1, check_finite=True).scores)(jnp.zeros((2, 2)))
