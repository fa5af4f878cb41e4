"""Router auxiliary terms: load-balancing loss, z-loss, aux-loss-free bias update, statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.routing.plan import DispatchPlan


def load_balancing_loss(logits: jax.Array, plan: DispatchPlan, k: int) -> jax.Array:
    """Switch-Transformer load-balancing loss, `E * sum_e f_e * p_e`.

    `f_e` is the fraction of token-choice rows sent to expert e (counts / (T*K)) and `p_e`
    the mean full-softmax router probability of expert e. It is 1 under perfect balance.

    Args:
      logits: [T, E] router logits.
      plan: the plan routed from these logits.
      k: experts per token.

    Returns:
      f32[] loss, differentiable in logits through `p_e`.
    """
    num_tokens, num_experts = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [T, E]
    tc_counts = token_choice_counts(plan)  # [E]
    fraction = tc_counts.astype(jnp.float32) / (num_tokens * k)  # [E]
    return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * jnp.mean(probs, axis=0))


def router_z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2. f32[]."""
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


def update_selection_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3): nudge the selection bias toward balance.

    `bias_e += rate * sign(mean_count - count_e)`: overloaded experts become less likely to
    be selected. Apply outside the optimizer, once per step; the bias never gets gradients.

    Args:
      bias: f32[E] current selection bias.
      counts: i32[E] rows per expert in the last step.
      rate: update speed (DeepSeek-V3 used 1e-3); a finite number >= 0 (a NaN or Inf rate
        would move every expert's bias to NaN / +-Inf and route all tokens to one expert).
    """
    rate = _checks.check_finite_number("rate", rate, minimum=0.0)
    counts = counts.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(counts) - counts)


def token_choice_counts(plan: DispatchPlan) -> jax.Array:
    """i32[E] token-choice rows per expert (rows added by token rounding excluded)."""
    return jax.ops.segment_sum(
        plan.is_token_choice.astype(jnp.int32), plan.expert_ids, num_segments=plan.num_experts
    )


def routing_stats(plan: DispatchPlan, tc_counts: jax.Array, tile: int) -> dict[str, jax.Array]:
    """Routing statistics of a plan against the token-choice routing it started from.

    Args:
      plan: the dispatch plan.
      tc_counts: i32[E] rows per expert under plain token-choice top-K.
      tile: GEMM tile height used to count padding waste.

    Returns:
      The dict of `stats_from_counts`.
    """
    return stats_from_counts(plan.group_sizes, tc_counts, token_choice_counts(plan), tile)


def stats_from_counts(
    counts: jax.Array, tc_counts: jax.Array, kept_tc_counts: jax.Array, tile: int
) -> dict[str, jax.Array]:
    """Routing statistics from per-expert counts (which may be summed over token shards).

    Args:
      counts: i32[E] rows per expert in the plan.
      tc_counts: i32[E] rows per expert under plain token-choice top-K.
      kept_tc_counts: i32[E] token-choice rows that stayed in the plan.
      tile: GEMM tile height used to count padding waste.

    Returns:
      counts i32[E]; dropped_rows (TC rows not in the plan), added_rows (non-TC rows in the
      plan), padding_rows (rows a grouped GEMM with this tile pads, for the plan) and
      tc_padding_rows (the same for plain token choice), padding_fraction and
      tc_padding_fraction (padding over padded rows), max_load (max count / mean count).
    """

    def padding(c):
        padded = ((c + tile - 1) // tile) * tile  # [E]
        waste = jnp.sum(padded - c)
        return waste, waste / jnp.maximum(jnp.sum(padded), 1)

    pad, pad_frac = padding(counts)
    tc_pad, tc_pad_frac = padding(tc_counts)
    mean = jnp.maximum(jnp.mean(counts.astype(jnp.float32)), 1e-9)
    return {
        "counts": counts,
        "dropped_rows": jnp.sum(tc_counts) - jnp.sum(kept_tc_counts),
        "added_rows": jnp.sum(counts) - jnp.sum(kept_tc_counts),
        "padding_rows": pad,
        "padding_fraction": pad_frac,
        "tc_padding_rows": tc_pad,
        "tc_padding_fraction": tc_pad_frac,
        "max_load": jnp.max(counts).astype(jnp.float32) / mean,
    }
