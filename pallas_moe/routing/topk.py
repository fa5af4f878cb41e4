"""Token-choice top-K routing (pure jnp, jit-able, static shapes)."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.routing.plan import DispatchPlan, plan_from_assignment

ScoreOrder = Literal["softmax_topk", "topk_softmax", "sigmoid"]
SCORE_ORDERS = ("softmax_topk", "topk_softmax", "sigmoid")


def check_router_inputs(
    logits: jax.Array, k: int, score: str, bias: jax.Array | None, check_finite: bool | None = None
) -> int:
    """Validates router inputs; returns k as an int. Shared by every router.

    `check_finite` is `_checks.check_finite`'s mode for the logits: None checks eager
    values only (no cost under `jit`), True also checks under `jit` through checkify.
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
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
    _, top_groups = jax.lax.top_k(group_score, topk_groups)  # [T, topk_groups]
    keep = jnp.sum(jax.nn.one_hot(top_groups, num_groups, dtype=jnp.int32), axis=1) > 0  # [T, G]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)


def router_probabilities(logits: jax.Array, score: ScoreOrder) -> jax.Array:
    """f32[T, E] per-expert router probability: full softmax, or sigmoid for `sigmoid`.

    This is the weight that rows added by token rounding carry, and what expert-choice
    candidates are ranked by.
    """
    logits = logits.astype(jnp.float32)
    if score == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)


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
    selection_score = probs if bias is None else probs + bias.astype(jnp.float32)[None, :]
    if score == "topk_softmax":
        selection_score = logits
    if num_groups is not None:
        selection_score = group_limited_scores(selection_score, num_groups, topk_groups)
    _, top_idx = jax.lax.top_k(selection_score, k)  # [T, K]
    selected = jnp.sum(jax.nn.one_hot(top_idx, num_experts, dtype=jnp.int32), axis=1) > 0  # [T, E]
    if score == "topk_softmax":
        masked = jnp.where(selected, logits, -jnp.inf)
        weights = jax.nn.softmax(masked, axis=-1)  # [T, E], zero off the top-K
    else:
        weights = jnp.where(selected, probs, 0.0)
        if renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return selected, weights


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
) -> DispatchPlan:
    """Token-choice top-K dispatch plan with static capacity `T*K` (no padding rows).

    Args and score orders as in `topk_assignment` (grouped top-K included). Scores are
    differentiable w.r.t. logits.
    check_finite: None (default) raises on NaN/Inf logits in eager calls and costs nothing
      under `jit`; True also checks under `jit` through `jax.experimental.checkify` (wrap
      the jitted function in `checkify.checkify`); False never checks.
    """
    k = check_router_inputs(logits, k, score, bias, check_finite)
    selected, weights = topk_assignment(
        logits, k, score=score, renormalize=renormalize, bias=bias,
        num_groups=num_groups, topk_groups=topk_groups,
    )
    return plan_from_assignment(selected, weights, selected, capacity=logits.shape[0] * k)
