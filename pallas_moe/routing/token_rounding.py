"""Token rounding (TR) routing, after SonicMoE: per-expert counts rounded to tile multiples.

Token-choice (TC) top-K assignments come first. Each expert's count `f_e` is rounded to a
multiple `r_e` of `tile`; its candidates are ranked TC rows first (by router probability),
then every other token by router probability (expert choice). The expert keeps the top
`r_e`: rounding up adds the best non-TC tokens, rounding down drops its lowest-scored TC
rows. So an expert deviates from TC by less than one tile, and only in its last tile.

Out of candidates: an expert cannot hold more than `T` rows. Where rounding up would need
more than `T`, the upper option is `T` itself (every token goes to that expert), which is
then not a multiple of `tile`; every mode chooses between the lower multiple and that
clamped upper option. That only happens when `T` is within a tile of `f_e`.

Two builds of one plan (`token_rounding_plan(impl=...)`), equal bitwise: "dense", the
reference (`token_rounding_assignment`: two sorts over [T, E], then `plan_from_assignment`),
and the fast path (`token_rounding_plan_fast`), which starts from the top-K pairs and
touches [T, E] only to pick each expert's `< tile` changes (docs/plan.md says how).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.routing.plan import DispatchPlan, plan_from_assignment
from pallas_moe.routing.topk import (
    ScoreOrder,
    TopKImpl,
    TopKPairs,
    check_groups,
    check_router_inputs,
    resolve_topk_impl,
    router_probabilities,
    topk_assignment,
    topk_pairs,
    total_order_key,
)

Rounding = Literal["nearest", "up", "down", "stochastic", "balance"]
ROUNDING_MODES = ("nearest", "up", "down", "stochastic", "balance")
_INT32_MIN = -(2**31)


def rounded_counts(
    counts: jax.Array,
    tile: int,
    rounding: Rounding,
    *,
    max_count: int,
    key: jax.Array | None = None,
) -> jax.Array:
    """Rounds per-expert token-choice counts to multiples of `tile`.

    Args:
      counts: i32[E] token-choice rows per expert.
      tile: the GEMM tile height `M_tile`.
      rounding: "nearest" (ties round down: dropping is cheaper than padding with EC
        tokens), "up", "down", "stochastic" (up with probability remainder/tile, so the
        expected count is unchanged; needs `key`), or "balance" (walks experts in order
        and picks up or down to keep the running total deviation within half a tile).
      max_count: static cap (the number of tokens T).
      key: PRNG key, required for "stochastic".

    Returns:
      i32[E] target rows per expert, `min(rounded, max_count)`.
    """
    counts = counts.astype(jnp.int32)
    down = (counts // tile) * tile  # [E]
    remainder = counts - down  # [E]
    # An expert holds at most max_count rows; clamping here (not only at the end) lets
    # "balance" account for the clamped count in its running deviation.
    up = jnp.minimum(jnp.where(remainder > 0, down + tile, down), max_count)  # [E]
    if rounding == "down":
        target = down
    elif rounding == "up":
        target = up
    elif rounding == "nearest":
        target = jnp.where(up - counts < remainder, up, down)
    elif rounding == "stochastic":
        if key is None:
            raise ValueError("key must be a PRNG key for rounding='stochastic', got None.")
        go_up = jax.random.uniform(key, counts.shape) * tile < remainder
        target = jnp.where(go_up, up, down)
    elif rounding == "balance":

        def step(deviation, count_down_up):
            count, lo, hi = count_down_up
            dev_lo, dev_hi = deviation + lo - count, deviation + hi - count
            pick_hi = jnp.abs(dev_hi) < jnp.abs(dev_lo)
            return jnp.where(pick_hi, dev_hi, dev_lo), jnp.where(pick_hi, hi, lo)

        _, target = jax.lax.scan(step, jnp.int32(0), (counts, down, up))
    else:
        _checks.check_choice("rounding", rounding, ROUNDING_MODES)
    return jnp.minimum(target, max_count).astype(jnp.int32)


def token_rounding_plan(
    logits: jax.Array,
    k: int,
    *,
    tile: int = 128,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    score: ScoreOrder = "softmax_topk",
    renormalize: bool = False,
    bias: jax.Array | None = None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    check_finite: bool | None = None,
    impl: TopKImpl = "auto",
) -> DispatchPlan:
    """Token-rounding dispatch plan with static capacity `T*K + E*tile`.

    Args:
      logits: [T, E] router logits (any float dtype; computed in f32).
      k: experts per token for the token-choice step.
      tile: GEMM tile height; per-expert counts become multiples of it.
      rounding: see `rounded_counts`.
      key: PRNG key for rounding="stochastic".
      score, renormalize, bias, num_groups, topk_groups: the token-choice step, as in
        `topk_plan` (grouped top-K limits the token-choice step only; rounding up adds
        the best other tokens of any expert).
      check_finite: NaN/Inf check of the logits, as in `topk_plan`.
      impl: "auto" (the fast path: with the routing kernel on GPU, "sort" elsewhere),
        "kernel", "interpret" (the kernel in interpret mode), "sort" (the fast path with
        jnp top-K) or "dense" (the O(T*E log T) reference: two sorts over [T, E]). All
        give the same plan and the same gradients to the logits, bitwise, eager or jitted
        (`routing.formulas` says how).

    Returns:
      A `DispatchPlan`. TC rows keep their top-K weight; added rows carry their full router
      probability (softmax over all experts, or sigmoid); `is_token_choice` tells them apart.

    The fast path (every impl but "dense") starts from the top-K pairs (`topk_pairs`) and
    changes each expert by less than one tile: it picks the `|target - count| < tile`
    tokens to drop (its worst TC rows) or to add (its best other tokens) with a two-level
    top-k per expert (`top_tokens_per_expert`), then places the kept and added rows with
    binary searches over those short per-expert lists: O(T*K*log(tile)) for the pairs,
    one pass over [T, E] for the candidates' chunk maxima, and sorts of about
    `sqrt(T * tile)` keys per expert; no sort or cumulative sum over [T, E].
    """
    return token_rounding_plan_and_counts(
        logits, k, tile=tile, rounding=rounding, key=key, score=score, renormalize=renormalize,
        bias=bias, num_groups=num_groups, topk_groups=topk_groups, check_finite=check_finite,
        impl=impl,
    )[0]


def token_rounding_plan_and_counts(
    logits: jax.Array,
    k: int,
    *,
    tile: int = 128,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    score: ScoreOrder = "softmax_topk",
    renormalize: bool = False,
    bias: jax.Array | None = None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    check_finite: bool | None = None,
    impl: TopKImpl = "auto",
) -> tuple[DispatchPlan, jax.Array]:
    """`token_rounding_plan` (same arguments) and the counts it was rounded from.

    Returns:
      (plan, tc_counts): the `DispatchPlan` and i32[E] plain top-K rows per expert (what
      the selection bias balances; `nn.functional.route` reports it). The top-K rows an
      expert kept are `minimum(plan.group_sizes, tc_counts)`: it either adds or drops.
    """
    k = check_router_inputs(logits, k, score, bias, check_finite)
    check_groups(logits.shape[1], k, num_groups, topk_groups)
    tile = _checks.check_positive_int("tile", tile)
    _checks.check_choice("rounding", rounding, ROUNDING_MODES)
    if rounding == "stochastic" and key is None:
        raise ValueError("key must be a PRNG key for rounding='stochastic', got None.")
    impl = resolve_topk_impl(impl)  # "auto": "kernel" on a GPU, "sort" elsewhere
    options = dict(
        tile=tile, rounding=rounding, key=key, score=score, renormalize=renormalize, bias=bias,
        num_groups=num_groups, topk_groups=topk_groups,
    )
    if impl != "dense":
        return token_rounding_plan_fast(logits, k, impl=impl, **options)
    selected, weights, tc_selected = token_rounding_assignment(logits, k, **options)
    num_tokens, num_experts = logits.shape
    plan = plan_from_assignment(
        selected, weights, selected & tc_selected, capacity=num_tokens * k + num_experts * tile
    )
    return plan, jnp.sum(tc_selected, axis=0, dtype=jnp.int32)


def token_rounding_plan_fast(
    logits: jax.Array,
    k: int,
    *,
    tile: int,
    rounding: Rounding,
    key: jax.Array | None = None,
    score: ScoreOrder = "softmax_topk",
    renormalize: bool = False,
    bias: jax.Array | None = None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    impl: str = "auto",
    chunk: int | None = None,
    round_by_kernels: bool = True,
) -> tuple[DispatchPlan, jax.Array]:
    """`token_rounding_plan`'s fast path (inputs checked by the caller).

    Args as in `token_rounding_plan`; `impl` picks the top-K step ("auto", "kernel",
    "interpret", "sort"); `chunk` overrides `selection_chunk` (tests, benchmarks);
    `round_by_kernels`: with the kernel impls, select with `kernels.select_largest` (where
    the lists fit) and place with `kernels.place_rounded`; False keeps the jnp selection
    (`lax.top_k` levels) and placement after the top-K kernels (benchmarks compare them).

    Returns:
      (plan, tc_counts): the `DispatchPlan` of `token_rounding_plan(impl="dense")`, bitwise,
      and i32[E] top-K rows per expert.
    """
    num_tokens, num_experts = logits.shape
    capacity = num_tokens * k + num_experts * tile
    pairs = topk_pairs(
        logits, k, score=score, renormalize=renormalize, bias=bias,
        num_groups=num_groups, topk_groups=topk_groups, impl=impl,
    )
    counts = pairs.group_sizes  # [E] top-K rows per expert
    target = rounded_counts(counts, tile, rounding, max_count=num_tokens, key=key)  # [E]
    grows = target > counts  # [E]: adds its best non-TC tokens
    shrinks = target < counts  # [E]: drops its worst TC rows
    change = jnp.abs(target - counts)  # [E], < tile and <= the expert's candidates
    max_change = min(tile - 1, num_tokens)

    # Added rows weigh their probability from a second `router_probabilities`, as the
    # reference does: the gradient to the logits is then the same sum of two softmax
    # backward passes (top-K weights, added rows), bitwise; one shared softmax would sum
    # the cotangents first and round differently. (Under jit the forward is computed once.)
    probs = router_probabilities(logits, score)  # [T, E]
    rank_score = jax.lax.stop_gradient(probs)  # selection has no gradient
    if bias is not None:
        rank_score = rank_score + bias.astype(jnp.float32)[None, :]
    # The reference's sort ranks -0.0 and +0.0 as equal, the total order does not; but a
    # rank score is never -0.0 (probabilities are >= +0.0, and p + b is -0.0 only if both are).
    rank_key = total_order_key(rank_score)  # [T, E]
    is_tc = jnp.any(
        pairs.experts[:, :, None] == jnp.arange(num_experts, dtype=jnp.int32), axis=1
    )  # [T, E]
    # Candidates per expert as keys to take the largest of. Adding: non-TC tokens by rank
    # score, ties to the lower token. Dropping: TC rows, lowest rank score first (so the
    # key is inverted) and, among equals, the higher token first.
    add_keys = jnp.where(is_tc, _INT32_MIN, rank_key)
    drop_keys = jnp.where(is_tc, ~rank_key, _INT32_MIN)
    keys = jnp.where(
        grows[None, :], add_keys, jnp.where(shrinks[None, :], drop_keys, _INT32_MIN)
    )  # [T, E]
    if chunk is None:
        chunk = selection_chunk(num_tokens, max_change)
    chunk = _checks.check_positive_int("chunk", chunk)
    kernel_impl = impl if impl in ("kernel", "interpret") and round_by_kernels else None
    if kernel_impl and fits_select_kernel(num_tokens, max_change, chunk):
        picked = tokens_per_expert_by_kernel(
            keys, change, shrinks, max_change, chunk, interpret=impl == "interpret"
        )  # [E, M] ascending tokens, then T
    else:
        # `lax.top_k` breaks ties to the lower index: reverse the dropping experts' tokens.
        reversed_keys = jnp.where(shrinks[None, :], keys[::-1], keys)
        picked = top_tokens_per_expert(reversed_keys, change, max_change, chunk)  # rank order
        picked = jnp.where(
            shrinks[:, None] & (picked < num_tokens), num_tokens - 1 - picked, picked
        )
        picked = jnp.sort(picked, axis=1)  # ascending tokens, then T
    added = jnp.where(grows[:, None], picked, num_tokens)  # [E, M]
    dropped = jnp.where(shrinks[:, None], picked, num_tokens)  # [E, M]
    return _assemble_plan(pairs, probs, target, added, dropped, capacity, kernel_impl), counts


def selection_chunk(num_tokens: int, max_count: int) -> int:
    """Tokens per chunk of `top_tokens_per_expert`'s first level (1: one level).

    A power of two near `sqrt(T / max_count)`, so both levels sort rows of about
    `sqrt(T * max_count)` keys; one level where T is small anyway.
    """
    if max_count == 0 or num_tokens <= 8 * max_count:
        return 1
    return 1 << round(math.log2(math.sqrt(num_tokens / max_count)))


def top_tokens_per_expert(keys: jax.Array, count: jax.Array, max_count: int, chunk: int) -> jax.Array:
    """Per expert, the tokens with its `count[e]` largest keys; ties go to the lower token.

    With `chunk > 1`, two levels of `lax.top_k` over short rows instead of one over T:
    first the `count[e]` best chunks of `chunk` tokens by their maximum key (ties to the
    lower chunk), then the best tokens inside them. Exact: a token outside those chunks has
    `count[e]` better tokens, one per chosen chunk (its maximum, which is larger, or equal
    and in a lower chunk, so a lower token).

    Args:
      keys: i32[T, E]. INT32_MIN marks a token that is no candidate of that expert.
      count: i32[E] tokens to pick per expert, each <= max_count and <= its candidates.
      max_count: static bound on `count` (<= T).
      chunk: static tokens per first-level chunk (`selection_chunk`); 1 for one level.

    Returns:
      i32[E, max_count]: each expert's picked tokens in rank order, then T.
    """
    num_tokens, num_experts = keys.shape
    if max_count == 0:
        return jnp.zeros((num_experts, 0), jnp.int32)
    if chunk <= 1:
        tokens = jax.lax.top_k(keys.T, max_count)[1]  # [E, M]
    else:
        num_chunks = -(-num_tokens // chunk)
        padded = jnp.pad(keys, ((0, num_chunks * chunk - num_tokens), (0, 0)),
                         constant_values=_INT32_MIN)
        chunk_max = jnp.max(padded.reshape(num_chunks, chunk, num_experts), axis=1).T  # [E, NC]
        best_chunks = jax.lax.top_k(chunk_max, min(max_count, num_chunks))[1]  # [E, k1]
        rank = jnp.arange(best_chunks.shape[1], dtype=jnp.int32)[None, :]
        # Ascending chunks, unused ones (num_chunks) last: the candidates below are then in
        # token order, which is how top_k breaks their ties.
        best_chunks = jnp.sort(jnp.where(rank < count[:, None], best_chunks, num_chunks), axis=1)
        candidates = (
            best_chunks[:, :, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)
        ).reshape(num_experts, -1)  # [E, k1 * chunk] tokens, ascending
        candidate_keys = jnp.where(
            candidates < num_tokens,
            keys[jnp.minimum(candidates, num_tokens - 1), jnp.arange(num_experts)[:, None]],
            _INT32_MIN,
        )
        best = jax.lax.top_k(candidate_keys, min(max_count, candidates.shape[1]))[1]
        tokens = jnp.take_along_axis(candidates, best, 1)  # [E, k2]
    rank = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    tokens = jnp.where(rank < count[:, None], tokens, num_tokens).astype(jnp.int32)
    return jnp.pad(tokens, ((0, 0), (0, max_count - tokens.shape[1])), constant_values=num_tokens)


def fits_select_kernel(num_tokens: int, max_count: int, chunk: int) -> bool:
    """Whether both selection levels fit `kernels.select_largest`'s per-program lists."""
    from pallas_moe.routing.kernels import MAX_SELECT_LENGTH

    if chunk <= 1:
        return num_tokens <= MAX_SELECT_LENGTH
    num_chunks = -(-num_tokens // chunk)
    return num_chunks <= MAX_SELECT_LENGTH and min(max_count, num_chunks) * chunk <= MAX_SELECT_LENGTH


def tokens_per_expert_by_kernel(
    keys: jax.Array, count: jax.Array, prefer_high: jax.Array, max_count: int, chunk: int,
    *, interpret: bool = False,
) -> jax.Array:
    """Per expert, the tokens with its `count[e]` largest keys, ascending, by the Pallas
    selection kernel (`kernels.select_largest`): `top_tokens_per_expert`'s two levels, each
    a radix select over one short list per expert instead of a `lax.top_k` and a sort.

    Level one picks each expert's `count[e]` best chunks of `chunk` tokens by their maximum
    key, level two the best tokens inside them (exact, as in `top_tokens_per_expert`; ties
    go to the lower chunk and token, or to the higher ones where `prefer_high`, both levels
    alike). Both return ascending indices, so no sort is needed.

    Args:
      keys: i32[T, E]; INT32_MIN marks a token that is no candidate of that expert.
      count: i32[E] tokens to pick, each <= max_count and <= the expert's candidates.
      prefer_high: bool[E] ties to the higher token (dropping experts).
      max_count: static bound on `count`.
      chunk: static tokens per first-level chunk (1: one level over all T tokens).
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      i32[E, max_count]: each expert's picked tokens ascending, then T.
    """
    from pallas_moe.routing import kernels  # Pallas is imported only when used.

    num_tokens, num_experts = keys.shape
    select = functools.partial(kernels.select_largest, interpret=interpret)
    if max_count == 0:
        return jnp.zeros((num_experts, 0), jnp.int32)
    if chunk <= 1:
        return select(keys.T, count, prefer_high, max_count=max_count)  # index == token
    num_chunks = -(-num_tokens // chunk)
    padded = jnp.pad(keys, ((0, num_chunks * chunk - num_tokens), (0, 0)),
                     constant_values=_INT32_MIN)
    chunk_max = jnp.max(padded.reshape(num_chunks, chunk, num_experts), axis=1).T  # [E, NC]
    num_best = min(max_count, num_chunks)
    best_chunks = select(
        chunk_max, jnp.minimum(count, num_best), prefer_high, max_count=num_best
    )  # [E, num_best] ascending, then NC (whose tokens are all >= T)
    candidates = (
        best_chunks[:, :, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)
    ).reshape(num_experts, -1)  # [E, num_best * chunk] tokens, ascending
    candidate_keys = jnp.where(
        candidates < num_tokens,
        keys[jnp.minimum(candidates, num_tokens - 1), jnp.arange(num_experts)[:, None]],
        _INT32_MIN,
    )
    best = select(candidate_keys, count, prefer_high, max_count=max_count)  # [E, M]
    length = candidates.shape[1]
    tokens = jnp.take_along_axis(candidates, jnp.minimum(best, length - 1), 1)
    return jnp.where(best < length, tokens, num_tokens).astype(jnp.int32)


def _count_below(sorted_rows: jax.Array, row: jax.Array, value: jax.Array) -> jax.Array:
    """i32[...]: how many entries of `sorted_rows[row]` (i32[R, M], ascending) are < value.

    `row` and `value` are i32[...]; `_count_below_by_search` of `bit_length(M)` gathers.
    """
    length = sorted_rows.shape[1]
    return _count_below_by_search(
        lambda i: sorted_rows[row, jnp.clip(i, 0, length - 1)], length, value, length
    )


def _count_below_in_segment(
    values: jax.Array, start: jax.Array, length: jax.Array, value: jax.Array, max_length: int
) -> jax.Array:
    """i32[...]: how many of `values[start:start + length]` (ascending) are < value.

    Args:
      values: i32[N]. start, length, value: i32[...]. max_length: static bound on length.
    """
    last = values.shape[0] - 1
    return _count_below_by_search(
        lambda i: values[jnp.clip(start + i, 0, last)], length, value, max_length
    )


def _count_below_by_search(read, length, value: jax.Array, max_length: int) -> jax.Array:
    """i32[...]: how many of the first `length` entries of an ascending list are < value.

    A branchless binary search that carries one count: for each power of two `step`,
    largest first, the count grows by `step` if the entry just past it is still < value.
    `read(i)` (i32[...] -> i32[...]) returns entry `i` of each query's list (and must
    accept any i in [-1, 2 * max_length)); `length` is an int or i32[...] <= max_length.

    Why one carried value and not (low, high): XLA fuses the unrolled search into one
    kernel, and its fused emitter re-emits a value for every use, so with two values each
    read by both next ones the program doubles per step. At 16 steps (T = 32768) XLA:CPU
    took 65-75 s to compile the (low, high) search alone (0.4 s this way).
    """
    count = jnp.zeros(value.shape, jnp.int32)
    step = 1 << (max_length.bit_length() - 1) if max_length > 0 else 0
    while step:
        probe = count + step  # the first `probe` entries are all < value?
        count = jnp.where((probe <= length) & (read(probe - 1) < value), probe, count)
        step //= 2
    return count


def _assemble_plan(
    pairs: TopKPairs,
    probs: jax.Array,
    target: jax.Array,
    added: jax.Array,
    dropped: jax.Array,
    capacity: int,
    kernel_impl: str | None = None,
) -> DispatchPlan:
    """The token-rounding plan from the top-K pairs and each expert's changes.

    Args:
      pairs: the top-K pairs (`topk_pairs`).
      probs: f32[T, E] router probabilities, the weights of added rows.
      target: i32[E] rows per expert after rounding.
      added: i32[E, M] tokens each expert adds, ascending, then T.
      dropped: i32[E, M] TC tokens each expert drops, ascending, then T. An expert adds or
        drops, never both.
      capacity: static row capacity P.
      kernel_impl: None (jnp) or "kernel" / "interpret": the rows, slots and scatters by
        the Pallas placement kernels (`kernels.place_rounded`).

    Rows are grouped by expert and ascending by token inside a group, as
    `plan_from_assignment` lays them out; each token's rows are listed by ascending expert.
    """
    experts = pairs.experts  # [T, K]
    num_tokens, k = experts.shape
    num_experts, max_change = added.shape
    counts = pairs.group_sizes
    token = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], experts.shape)
    added_expert = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32)[:, None], added.shape)
    is_added = added < num_tokens  # [E, M]
    added_token = jnp.minimum(added, num_tokens - 1)
    added_scores = probs[added_token, added_expert]  # [E, M] full router probability
    added_count, added_experts_below = _added_expert_sets(added, num_tokens)

    if kernel_impl is not None:
        from pallas_moe.routing import kernels  # Pallas is imported only when used.

        dropped_count = jnp.zeros((num_tokens,), jnp.int32).at[dropped.reshape(-1)].add(
            1, mode="drop")  # [T]; T (no token) is dropped by the scatter
        token_row_offsets = _offsets(k - dropped_count + added_count)
        token_ids, scores, is_token_choice, rows_by_token = kernels.place_rounded(
            experts, pairs.rows, pairs.weights, pairs.token_ids, counts, target, dropped,
            added, added_scores, token_row_offsets[:-1],
            added_experts_below(token, experts), added_experts_below(added_token, added_expert),
            capacity=capacity, interpret=kernel_impl == "interpret",
        )
        return DispatchPlan(
            token_ids=token_ids, scores=scores, group_sizes=target.astype(jnp.int32),
            is_token_choice=is_token_choice, rows_by_token=rows_by_token,
            token_row_offsets=token_row_offsets,
        )

    tc_start = jnp.cumsum(counts, dtype=jnp.int32) - counts  # [E]
    new_start = jnp.cumsum(target, dtype=jnp.int32) - target  # [E]
    # Top-K pairs: a kept pair moves by the drops and adds of its expert before its token.
    dropped_before = _count_below(dropped, experts, token)  # [T, K]
    is_dropped = (
        dropped[experts, jnp.minimum(dropped_before, max_change - 1)] == token
        if max_change else jnp.zeros(experts.shape, bool)
    )
    kept = ~is_dropped
    added_before = _count_below(added, experts, token)  # [T, K]
    tc_row = (
        new_start[experts] + pairs.rows - tc_start[experts] - dropped_before + added_before
    )  # [T, K]

    # Added pairs: after the expert's TC rows of lower tokens and its earlier added ones.
    tc_below = _count_below_in_segment(
        pairs.token_ids, tc_start[added_expert], counts[added_expert], added, num_tokens
    )  # [E, M]: TC tokens of the expert below the added token
    added_row = new_start[:, None] + tc_below + jnp.arange(max_change, dtype=jnp.int32)[None, :]

    row = jnp.concatenate([
        jnp.where(kept, tc_row, capacity).reshape(-1),
        jnp.where(is_added, added_row, capacity).reshape(-1),
    ])  # [T*K + E*M]; capacity: no row (dropped by the scatters)
    token_ids = jnp.zeros((capacity,), jnp.int32).at[row].set(
        jnp.concatenate([token.reshape(-1), added.reshape(-1)]), mode="drop"
    )
    scores = jnp.zeros((capacity,), jnp.float32).at[row].set(
        jnp.concatenate([pairs.weights.reshape(-1), added_scores.reshape(-1)]).astype(jnp.float32),
        mode="drop",
    )
    is_token_choice = jnp.zeros((capacity,), bool).at[row].set(
        jnp.arange(row.shape[0]) < num_tokens * k, mode="drop"
    )

    # Per token (CSR): its kept TC rows and its added rows, by ascending expert.
    kept_i = kept.astype(jnp.int32)
    token_row_offsets = _offsets(jnp.sum(kept_i, axis=1) + added_count)  # [T+1]
    tc_slot = (
        token_row_offsets[:-1, None] + jnp.cumsum(kept_i, axis=1) - kept_i
        + added_experts_below(token, experts)
    )  # [T, K]; a token's TC experts are ascending
    kept_tc_below = jnp.sum(
        (experts[added_token] < added_expert[:, :, None]) & kept[added_token], axis=2,
        dtype=jnp.int32,
    )  # [E, M]
    added_slot = (
        token_row_offsets[added_token] + kept_tc_below
        + added_experts_below(added_token, added_expert)
    )
    slot = jnp.concatenate([
        jnp.where(kept, tc_slot, capacity).reshape(-1),
        jnp.where(is_added, added_slot, capacity).reshape(-1),
    ])
    # Slots past the real rows point at themselves, as in `plan_from_assignment`.
    rows_by_token = jnp.arange(capacity, dtype=jnp.int32).at[slot].set(row, mode="drop")
    return DispatchPlan(
        token_ids=token_ids,
        scores=scores,
        group_sizes=target.astype(jnp.int32),
        is_token_choice=is_token_choice,
        rows_by_token=rows_by_token,
        token_row_offsets=token_row_offsets,
    )


def _offsets(rows_per_token: jax.Array) -> jax.Array:
    """i32[T + 1] CSR offsets from i32[T] rows per token."""
    return jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(rows_per_token, dtype=jnp.int32)]
    )


def _added_expert_sets(added: jax.Array, num_tokens: int):
    """Each token's added experts as a bit set (32 experts a word), so "added experts
    below e" is a popcount, not a sort of the added pairs by token.

    Args:
      added: i32[E, M] tokens each expert adds, then T.

    Returns:
      (added_count i32[T], added_experts_below): the token's added experts, and a function
      `(tok, expert) -> i32[...]` counting the added experts of `tok` below `expert`.
    """
    num_experts = added.shape[0]
    added_expert = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32)[:, None], added.shape)
    num_words = -(-num_experts // 32)
    word, bit = added_expert // 32, (added_expert % 32).astype(jnp.uint32)
    added_bits = jnp.zeros((num_tokens, num_words), jnp.uint32).at[added, word].add(
        jnp.left_shift(jnp.uint32(1), bit), mode="drop"
    )  # bits are distinct: add is or; T (no token) is dropped
    word_count = jax.lax.population_count(added_bits).astype(jnp.int32)  # [T, W]
    words_before = jnp.cumsum(word_count, axis=1, dtype=jnp.int32) - word_count  # [T, W]

    def added_experts_below(tok, expert):
        """Added experts of token `tok` below `expert` (both i32[...])."""
        w = expert // 32
        below_in_word = added_bits[tok, w] & (
            jnp.left_shift(jnp.uint32(1), (expert % 32).astype(jnp.uint32)) - jnp.uint32(1)
        )
        return words_before[tok, w] + jax.lax.population_count(below_in_word).astype(jnp.int32)

    return jnp.sum(word_count, axis=1), added_experts_below


def token_rounding_assignment(
    logits: jax.Array,
    k: int,
    *,
    tile: int,
    rounding: Rounding,
    key: jax.Array | None = None,
    score: ScoreOrder = "softmax_topk",
    renormalize: bool = False,
    bias: jax.Array | None = None,
    num_groups: int | None = None,
    topk_groups: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token rounding as a dense assignment (the reference; `token_rounding_plan` args).

    Returns:
      (selected bool[T, E], weights f32[T, E], token_choice bool[T, E]): the TR assignment,
      its weights, and the plain top-K assignment it was rounded from.
    """
    num_tokens = logits.shape[0]
    tc_selected, tc_weights = topk_assignment(
        logits, k, score=score, renormalize=renormalize, bias=bias,
        num_groups=num_groups, topk_groups=topk_groups,
    )  # [T, E] each
    probs = router_probabilities(logits, score)  # [T, E]
    rank_score = probs if bias is None else probs + bias.astype(jnp.float32)[None, :]
    counts = jnp.sum(tc_selected, axis=0, dtype=jnp.int32)  # [E]
    target = rounded_counts(counts, tile, rounding, max_count=num_tokens, key=key)  # [E]

    # Rank every token per expert: TC rows first, each part by score, ties by token index.
    # A stable sort of -score within a stable sort of -is_tc gives exactly that order.
    order = jnp.argsort(-rank_score, axis=0, stable=True)  # [T, E]
    order = jnp.take_along_axis(
        order, jnp.argsort(~jnp.take_along_axis(tc_selected, order, 0), axis=0, stable=True), 0
    )  # [T, E] token ids in priority order per expert
    rank = jnp.zeros_like(order).at[order, jnp.arange(order.shape[1])[None, :]].set(
        jnp.broadcast_to(jnp.arange(num_tokens, dtype=order.dtype)[:, None], order.shape)
    )  # [T, E] priority rank of each token for each expert
    selected = rank < target[None, :]
    weights = jnp.where(selected, jnp.where(tc_selected, tc_weights, probs), 0.0)
    return selected, weights, tc_selected
