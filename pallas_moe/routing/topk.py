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

    Returns:
      (selected bool[T, E], weights f32[T, E]); weights are 0 where not selected.
    """
    logits = logits.astype(jnp.float32)  # [T, E]
    num_experts = logits.shape[1]
    probs = router_probabilities(logits, score)  # [T, E]
    selection_score = probs if bias is None else probs + bias.astype(jnp.float32)[None, :]
    if score == "topk_softmax":
        selection_score = logits
    _, top_idx = jax.lax.top_k(selection_score, k)  # [T, K]
    selected = jnp.sum(jax.nn.one_hot(top_idx, num_experts, dtype=jnp.int32), axis=1) > 0  # [T, E]
    if score == "topk_softmax":
        masked = jnp.where(selected, logits, -jnp.inf)
        weights = jax.nn.softmax(masked, axis=-1)  # [T, E], zero off the top-K
    else:
        weights = jnp.where(selected, probs, 0.0)
        if renormalize:
            # p_e / sum of the selected p, as a softmax of log p over the selected experts:
            # never 0/0, even where every selected sigmoid underflows (logits <= -90).
            log_probs = (
                jax.nn.log_sigmoid(logits) if score == "sigmoid" else jax.nn.log_softmax(logits, axis=-1)
            )
            weights = jax.nn.softmax(jnp.where(selected, log_probs, -jnp.inf), axis=-1)
    return selected, weights


def topk_plan(
    logits: jax.Array,
    k: int,
    *,
    score: ScoreOrder = "softmax_topk",
    renormalize: bool = False,
    bias: jax.Array | None = None,
    check_finite: bool | None = None,
) -> DispatchPlan:
    """Token-choice top-K dispatch plan with static capacity `T*K` (no padding rows).

    Args and score orders as in `topk_assignment`. Scores are differentiable w.r.t. logits.
    check_finite: None (default) raises on NaN/Inf logits in eager calls and costs nothing
      under `jit`; True also checks under `jit` through `jax.experimental.checkify` (wrap
      the jitted function in `checkify.checkify`); False never checks.
    """
    k = check_router_inputs(logits, k, score, bias, check_finite)
    selected, weights = topk_assignment(logits, k, score=score, renormalize=renormalize, bias=bias)
    return plan_from_assignment(selected, weights, selected, capacity=logits.shape[0] * k)
