"""Token-choice top-K routing (jit-able, static shapes).

Three implementations of one plan (`impl=`), equal row for row:
- "kernel": a Pallas (Triton) kernel ranks the selection scores, builds per-block expert
  histograms and local ranks in one pass; a prefix sum over spans of blocks and one scatter
  place the `T*K` pairs in grouped order (`routing/kernels.py`). The default on GPUs.
- "sort": O(T*K) jnp: `lax.top_k`, then a stable sort of the `T*K` expert ids. The default
  elsewhere (CPU).
- "dense": the original O(T*E) one-hot formulation (`topk_assignment` +
  `plan_from_assignment`), kept as the reference the others are tested against.
"interpret" runs the kernel in Pallas interpret mode (CPU tests).

Selection scores are computed by the same formulas in every implementation
(`routing.formulas`: the same bits in any program), and ranked in the total
order of `jax.lax.top_k` (ties go to the lower expert index), so the selected experts are
identical; weights are computed from the same probabilities, over the K experts in the
reference's order (`topk_reference_weights`), so they and the gradients to the logits are
bitwise those of the reference. `topk_pairs` gives the pairs themselves (token rounding starts
from them).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.routing import formulas
from pallas_moe.routing.plan import DispatchPlan, plan_from_assignment

TopKImpl = Literal["auto", "kernel", "interpret", "sort", "dense"]
TOPK_IMPLS = ("auto", "kernel", "interpret", "sort", "dense")

ScoreOrder = Literal["softmax_topk", "topk_softmax", "sigmoid"]
SCORE_ORDERS = ("softmax_topk", "topk_softmax", "sigmoid")


def check_router_inputs(
    logits: jax.Array, k: int, score: str, bias: jax.Array | None, check_finite: bool | None = None
) -> int:
    """Validates router inputs; returns k as an int. Shared by every router.

    `check_finite` is `_checks.check_finite`'s mode for the bias and the logits: None checks
    eager values only (no cost under `jit`), True also checks under `jit` through checkify.
    """
    _checks.check_floating("logits", logits, ndim=2)
    num_tokens, num_experts = logits.shape
    if num_tokens == 0 or num_experts == 0:
        raise ValueError(f"logits must be [T, E] with T, E >= 1, got shape {logits.shape}.")
    k = _checks.check_positive_int("k", k)
    if k > num_experts:
        raise ValueError(f"k={k} must be <= the number of experts E={num_experts} (logits.shape[1]).")
    _checks.check_choice("score", score, SCORE_ORDERS)
    if bias is not None:
        if score != "sigmoid":
            raise ValueError(f"bias (selection bias) is only used with score='sigmoid', got {score!r}.")
        _checks.check_floating("bias", bias, ndim=1)
        if bias.shape != (num_experts,):
            raise ValueError(f"bias must have shape [E]=({num_experts},), got {bias.shape}.")
        # A non-finite bias silently routes every token to the experts it makes +inf / NaN.
        _checks.check_finite("bias", bias, check_finite)
    _checks.check_finite("logits", logits, check_finite)
    return k


def check_groups(num_experts: int, k: int, num_groups: int | None, topk_groups: int | None) -> None:
    """Validates grouped top-K options (DeepSeek-V3's `n_group` / `topk_group`)."""
    if num_groups is None and topk_groups is None:
        return
    if num_groups is None or topk_groups is None:
        raise ValueError(
            f"num_groups and topk_groups go together (grouped top-K), got num_groups={num_groups!r}, "
            f"topk_groups={topk_groups!r}."
        )
    num_groups = _checks.check_positive_int("num_groups", num_groups)
    topk_groups = _checks.check_positive_int("topk_groups", topk_groups)
    if num_experts % num_groups or num_experts // num_groups < 2:
        raise ValueError(
            f"num_groups={num_groups} must divide the E={num_experts} experts into groups of at "
            "least 2 (the group score sums each group's top-2 scores)."
        )
    if topk_groups > num_groups:
        raise ValueError(f"topk_groups={topk_groups} must be <= num_groups={num_groups}.")
    if k > topk_groups * (num_experts // num_groups):
        raise ValueError(
            f"k={k} experts cannot be chosen from topk_groups={topk_groups} groups of "
            f"{num_experts // num_groups} experts."
        )


def group_limited_scores(selection_score: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
    """Masks to -inf every expert outside each token's best `topk_groups` expert groups.

    DeepSeek-V3's group-limited routing: experts form `num_groups` contiguous groups of
    `E / num_groups`; a group's score is the sum of its two highest selection scores
    (biased scores when a selection bias is used); each token keeps its `topk_groups`
    best groups. (Hugging Face's DeepseekV3 fills the masked scores with 0 instead of
    -inf; the two agree whenever the chosen experts' selection scores are positive.)

    Args:
      selection_score: f32[T, E], what top-K ranks.

    Returns:
      f32[T, E], equal to selection_score inside the kept groups and -inf elsewhere.
    """
    num_tokens, num_experts = selection_score.shape
    grouped = selection_score.reshape(num_tokens, num_groups, num_experts // num_groups)
    top2 = jax.lax.top_k(grouped, 2)[0]  # [T, G, 2]
    group_score = top2[..., 0] + top2[..., 1]  # [T, G]; one add, no reduction order
    _, top_groups = jax.lax.top_k(group_score, topk_groups)  # [T, topk_groups]
    keep = jnp.sum(jax.nn.one_hot(top_groups, num_groups, dtype=jnp.int32), axis=1) > 0  # [T, G]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)


def router_probabilities(logits: jax.Array, score: ScoreOrder) -> jax.Array:
    """f32[T, E] per-expert router probability: full softmax, or sigmoid for `sigmoid`.

    This is the weight that rows added by token rounding carry, and what expert-choice
    candidates are ranked by. Computed by `routing.formulas`, whose formulas give the same
    bits (and gradients) in every program that calls them.
    """
    logits = logits.astype(jnp.float32)
    return formulas.sigmoid(logits) if score == "sigmoid" else formulas.softmax(logits)


def selection_scores(
    logits: jax.Array,
    probs: jax.Array,
    score: ScoreOrder,
    bias: jax.Array | None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
) -> jax.Array:
    """f32[T, E] what top-K ranks: the logits for "topk_softmax", else the probabilities
    plus the optional selection bias (which moves selection, never the weights); with
    grouped top-K, experts outside each token's best groups are -inf
    (`group_limited_scores`)."""
    if score == "topk_softmax":
        sel = logits.astype(jnp.float32)
    else:
        sel = probs if bias is None else probs + bias.astype(jnp.float32)[None, :]
    if num_groups is not None:
        sel = group_limited_scores(sel, num_groups, topk_groups)
    return sel


def topk_weights(
    logits: jax.Array, probs: jax.Array, experts: jax.Array, score: ScoreOrder, renormalize: bool
) -> jax.Array:
    """f32[T, K] router weight of each selected (token, expert); differentiable in logits.

    `experts` i32[T, K] are the selected experts (any order). "topk_softmax" takes a softmax
    over the K selected logits; the others take the probabilities, rescaled to sum to 1 per
    token if `renormalize` (as a softmax of log p over the selected experts: never 0/0, even
    where every selected sigmoid underflows at logits <= -90). Every implementation of the
    router computes its weights here.
    """
    logits = logits.astype(jnp.float32)
    if score == "topk_softmax":
        return formulas.softmax(jnp.take_along_axis(logits, experts, 1))
    if renormalize:
        log_probs = (formulas.log_sigmoid if score == "sigmoid" else formulas.log_softmax)(logits)
        return formulas.softmax(jnp.take_along_axis(log_probs, experts, 1))
    return jnp.take_along_axis(probs, experts, axis=1)  # [T, K]


def topk_assignment(
    logits: jax.Array,
    k: int,
    *,
    score: ScoreOrder = "softmax_topk",
    renormalize: bool = False,
    bias: jax.Array | None = None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Top-K choice per token as a dense assignment.

    Args:
      logits: [T, E] router logits.
      k: experts per token.
      score: "softmax_topk" (softmax over all E, then top-K), "topk_softmax" (top-K on
        logits, then softmax over the K), or "sigmoid" (independent sigmoid scores).
      renormalize: rescale each token's K weights to sum to 1 (softmax_topk, sigmoid).
      bias: f32[E] selection bias for "sigmoid" (aux-loss-free balancing): it moves which
        experts are selected, never the weights.
      num_groups, topk_groups: grouped top-K (DeepSeek-V3 `n_group` / `topk_group`): pick
        the K experts only from each token's best `topk_groups` of `num_groups` contiguous
        expert groups (see `group_limited_scores`). Both None (default): plain top-K.

    Returns:
      (selected bool[T, E], weights f32[T, E]); weights are 0 where not selected.
    """
    logits = logits.astype(jnp.float32)  # [T, E]
    num_experts = logits.shape[1]
    check_groups(num_experts, k, num_groups, topk_groups)
    probs = router_probabilities(logits, score)  # [T, E]
    selection_score = selection_scores(logits, probs, score, bias, num_groups, topk_groups)
    _, top_idx = jax.lax.top_k(selection_score, k)  # [T, K]
    selected = jnp.sum(jax.nn.one_hot(top_idx, num_experts, dtype=jnp.int32), axis=1) > 0  # [T, E]
    weights_k = topk_weights(logits, probs, top_idx, score, renormalize)  # [T, K]
    token = jnp.arange(logits.shape[0])[:, None]
    weights = jnp.zeros_like(logits).at[token, top_idx].set(weights_k)  # [T, E], 0 off top-K
    return selected, weights


def resolve_topk_impl(impl: str) -> str:
    """Maps "auto" to "kernel" on a GPU and to "sort" elsewhere."""
    _checks.check_choice("impl", impl, TOPK_IMPLS)
    if impl != "auto":
        return impl
    return "kernel" if jax.default_backend() == "gpu" else "sort"


class TopKPairs(NamedTuple):
    """The `T*K` token-choice (token, expert) pairs of a top-K plan, token-major.

    Attributes:
      experts: i32[T, K] each token's experts, ascending.
      weights: f32[T, K] router weight of each pair (differentiable in the logits), bitwise
        the reference's (`topk_reference_weights`).
      rows: i32[T, K] grouped row of each pair in the top-K plan.
      group_sizes: i32[E] pairs per expert.
      token_ids: i32[T*K] token of each grouped row (ascending within an expert's group).
      scores: f32[T*K] weight of each grouped row.
      token_row_offsets: i32[T + 1] the plan's CSR offsets (`t * K`) where the routing
        program wrote them, else None (`_topk_plan` computes them).
    """

    experts: jax.Array
    weights: jax.Array
    rows: jax.Array
    group_sizes: jax.Array
    token_ids: jax.Array
    scores: jax.Array
    token_row_offsets: jax.Array | None = None


def topk_plan(
    logits: jax.Array,
    k: int,
    *,
    score: ScoreOrder = "softmax_topk",
    renormalize: bool = False,
    bias: jax.Array | None = None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    check_finite: bool | None = None,
    impl: TopKImpl = "auto",
) -> DispatchPlan:
    """Token-choice top-K dispatch plan with static capacity `T*K` (no padding rows).

    Args and score orders as in `topk_assignment` (grouped top-K included). Scores are
    differentiable w.r.t. logits.
    check_finite: None (default) raises on NaN/Inf logits in eager calls and costs nothing
      under `jit`; True also checks under `jit` through `jax.experimental.checkify` (wrap
      the jitted function in `checkify.checkify`); False never checks.
    impl: "auto" (the routing kernel on GPU, "sort" elsewhere), "kernel", "interpret"
      (the kernel in interpret mode), "sort" (O(T*K) jnp) or "dense" (the O(T*E)
      reference). All give the same plan.
    """
    k = check_router_inputs(logits, k, score, bias, check_finite)
    impl = resolve_topk_impl(impl)
    if impl == "dense":
        selected, weights = topk_assignment(
            logits, k, score=score, renormalize=renormalize, bias=bias,
            num_groups=num_groups, topk_groups=topk_groups,
        )
        return plan_from_assignment(selected, weights, selected, capacity=logits.shape[0] * k)
    pairs = topk_pairs(
        logits, k, score=score, renormalize=renormalize, bias=bias,
        num_groups=num_groups, topk_groups=topk_groups, impl=impl,
    )
    return _topk_plan(pairs.token_ids, pairs.scores, pairs.rows, pairs.group_sizes,
                      pairs.token_row_offsets)


def topk_pairs(
    logits: jax.Array,
    k: int,
    *,
    score: ScoreOrder = "softmax_topk",
    renormalize: bool = False,
    bias: jax.Array | None = None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    impl: str = "auto",
) -> TopKPairs:
    """The top-K pairs by a fast path: O(T*K) work past the [T, E] scores (no sort over E).

    Inputs are those of `topk_plan` (checked by the caller with `check_router_inputs`);
    `impl` is "auto", "kernel", "interpret" or "sort" (not "dense").
    """
    impl = resolve_topk_impl(impl)
    if impl == "dense":
        raise ValueError("topk_pairs has no dense implementation; use impl='sort' or 'kernel'.")
    check_groups(logits.shape[1], k, num_groups, topk_groups)
    logits = logits.astype(jnp.float32)
    num_experts = logits.shape[1]
    probs = router_probabilities(logits, score)  # [T, E]
    sel = selection_scores(logits, probs, score, bias, num_groups, topk_groups)  # [T, E]
    if impl == "sort":
        ranked = jax.lax.top_k(jax.lax.stop_gradient(sel), k)[1]  # [T, K], lax.top_k order
        ranked_weights = topk_weights(logits, probs, ranked, score, renormalize)  # [T, K]
        ascending = jnp.argsort(ranked, axis=1)
        experts = jnp.take_along_axis(ranked, ascending, 1)  # [T, K]
        weights = jnp.take_along_axis(ranked_weights, ascending, 1)
        rows, group_sizes = _grouped_rows_by_sort(experts, num_experts)
        token_ids, scores = _scatter_token_rows(rows, weights)
        return TopKPairs(experts, weights, rows, group_sizes, token_ids, scores)
    from pallas_moe.routing import kernels  # Pallas is imported only when used.

    interpret = impl == "interpret"
    if logits.shape[0] <= kernels.small_batch_limit():  # decode sizes: one program
        experts, rows, group_sizes, token_ids, pair_ids, offsets = kernels.topk_small(
            jax.lax.stop_gradient(sel), k, interpret=interpret
        )
        weights = topk_reference_weights(logits, probs, sel, experts, score, renormalize)
        # The grouped scores by a gather through each row's pair (fused by XLA into the
        # weights' formula), not a scatter into zeros: the same values, one launch less.
        scores = weights.reshape(-1).astype(jnp.float32).at[pair_ids].get(
            unique_indices=True, mode="promise_in_bounds"
        )
        return TopKPairs(experts, weights, rows, group_sizes, token_ids, scores, offsets)
    block_t = kernels.block_tokens(num_experts)
    experts, local_rank, block_counts = kernels.topk_blocks(  # selection: no gradient
        jax.lax.stop_gradient(sel), k, interpret=interpret, block_t=block_t
    )
    group_sizes, span_base = kernels.span_bases(block_counts)
    weights = topk_reference_weights(logits, probs, sel, experts, score, renormalize)  # [T, K]
    token_ids, scores, rows = kernels.place_pairs(
        experts, local_rank, weights, span_base, block_counts, block_t=block_t,
        interpret=interpret,
    )
    return TopKPairs(experts, weights, rows, group_sizes, token_ids, scores)


def topk_reference_weights(
    logits: jax.Array,
    probs: jax.Array,
    sel: jax.Array,
    experts: jax.Array,
    score: ScoreOrder,
    renormalize: bool,
) -> jax.Array:
    """f32[T, K] `topk_weights` of `experts` (i32[T, K], each token's experts ascending),
    bitwise as the reference computes them.

    Where a weight depends on the other selected experts (softmax over the K for
    "topk_softmax" or `renormalize`), the reference sums over the K experts in
    `lax.top_k`'s order, and float sums depend on order. So the experts are put in that
    order (selection score descending in IEEE total order, ties to the lower expert: a
    K x K count per token, no sort), weighed, and the weights put back in ascending order.
    """
    if score != "topk_softmax" and not renormalize:
        return topk_weights(logits, probs, experts, score, renormalize)  # a gather: no order
    num_k = experts.shape[1]
    key = total_order_key(jnp.take_along_axis(jax.lax.stop_gradient(sel), experts, 1))  # [T, K]
    # rank[t, i]: pairs of token t that lax.top_k puts before pair i.
    ahead = (key[:, None, :] > key[:, :, None]) | (
        (key[:, None, :] == key[:, :, None]) & (experts[:, None, :] < experts[:, :, None])
    )  # [T, K(i), K(j)]: j before i
    rank = jnp.sum(ahead, axis=2, dtype=jnp.int32)  # [T, K], a permutation of 0..K-1 per token
    ranked = jnp.sum(
        jnp.where(rank[:, :, None] == jnp.arange(num_k)[None, None, :], experts[:, :, None], 0),
        axis=1, dtype=jnp.int32,
    )  # [T, K] experts in lax.top_k order
    ranked_weights = topk_weights(logits, probs, ranked, score, renormalize)
    return jnp.take_along_axis(ranked_weights, rank, 1)


def total_order_key(x: jax.Array) -> jax.Array:
    """i32 key whose signed order is the IEEE total order of the f32 `x` (lax.top_k's order:
    -0.0 < +0.0, NaN above +inf)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _grouped_rows_by_sort(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(rows i32[T, K], group_sizes i32[E]): grouped row of each pair by a stable sort."""
    num_tokens, k = experts.shape
    flat = experts.reshape(-1)  # token-major, so stable order is by token within an expert
    order = jnp.argsort(flat, stable=True)  # grouped row -> pair
    rows = jnp.zeros_like(flat).at[order].set(
        jnp.arange(flat.shape[0], dtype=jnp.int32), unique_indices=True
    )
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return rows.reshape(num_tokens, k), group_sizes


def _scatter_token_rows(rows: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(token_ids i32[T*K], scores f32[T*K]) in grouped order from each pair's row.

    Args:
      rows: i32[T, K] grouped row of each pair (a permutation of `[0, T*K)`).
      weights: f32[T, K] router weight of each pair.
    """
    num_tokens, k = rows.shape
    flat_rows = rows.reshape(-1)
    token_of_pair = jnp.repeat(jnp.arange(num_tokens, dtype=jnp.int32), k)  # [T*K]
    token_ids = jnp.zeros((flat_rows.shape[0],), jnp.int32).at[flat_rows].set(
        token_of_pair, unique_indices=True
    )
    return token_ids, _scatter_scores(rows, weights)


def _scatter_scores(rows: jax.Array, weights: jax.Array) -> jax.Array:
    """f32[T*K] each pair's weight (f32[T, K]) at its grouped row (i32[T, K], a permutation
    of `[0, T*K)`); differentiable (the transpose is a gather)."""
    flat_rows = rows.reshape(-1)
    return jnp.zeros((flat_rows.shape[0],), jnp.float32).at[flat_rows].set(
        weights.reshape(-1).astype(jnp.float32), unique_indices=True
    )


def _topk_plan(token_ids, scores, rows, group_sizes, offsets=None) -> DispatchPlan:
    """The top-K `DispatchPlan`: every row is a token-choice row, each token holds K rows
    (`offsets`, i32[T + 1], are `t * K`: computed here unless the routing program wrote them)."""
    num_tokens, k = rows.shape
    capacity = token_ids.shape[0]
    if offsets is None:
        offsets = jnp.arange(num_tokens + 1, dtype=jnp.int32) * k
    return DispatchPlan(
        token_ids=token_ids,
        scores=scores,
        group_sizes=group_sizes.astype(jnp.int32),
        is_token_choice=jnp.ones((capacity,), bool),
        rows_by_token=rows.reshape(-1).astype(jnp.int32),
        token_row_offsets=offsets,
    )
