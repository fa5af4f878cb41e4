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
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.routing.plan import DispatchPlan, plan_from_assignment
from pallas_moe.routing.topk import (
    ScoreOrder,
    check_router_inputs,
    router_probabilities,
    topk_assignment,
)

Rounding = Literal["nearest", "up", "down", "stochastic", "balance"]
ROUNDING_MODES = ("nearest", "up", "down", "stochastic", "balance")


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
    check_finite: bool | None = None,
) -> DispatchPlan:
    """Token-rounding dispatch plan with static capacity `T*K + E*tile`.

    Args:
      logits: [T, E] router logits.
      k: experts per token for the token-choice step.
      tile: GEMM tile height; per-expert counts become multiples of it.
      rounding: see `rounded_counts`.
      key: PRNG key for rounding="stochastic".
      score, renormalize, bias: the token-choice step, as in `topk_plan`.
      check_finite: NaN/Inf check of the logits, as in `topk_plan`.

    Returns:
      A `DispatchPlan`. TC rows keep their top-K weight; added rows carry their full router
      probability (softmax over all experts, or sigmoid); `is_token_choice` tells them apart.
    """
    k = check_router_inputs(logits, k, score, bias, check_finite)
    tile = _checks.check_positive_int("tile", tile)
    _checks.check_choice("rounding", rounding, ROUNDING_MODES)
    if rounding == "stochastic" and key is None:
        raise ValueError("key must be a PRNG key for rounding='stochastic', got None.")
    selected, weights, tc_selected = token_rounding_assignment(
        logits, k, tile=tile, rounding=rounding, key=key, score=score,
        renormalize=renormalize, bias=bias,
    )
    num_tokens, num_experts = logits.shape
    return plan_from_assignment(
        selected, weights, selected & tc_selected, capacity=num_tokens * k + num_experts * tile
    )


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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token rounding as a dense assignment.

    Returns:
      (selected bool[T, E], weights f32[T, E], token_choice bool[T, E]): the TR assignment,
      its weights, and the plain top-K assignment it was rounded from.
    """
    num_tokens = logits.shape[0]
    tc_selected, tc_weights = topk_assignment(
        logits, k, score=score, renormalize=renormalize, bias=bias
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
