"""Routing: pure jnp, jit-able, static shapes. Produces `DispatchPlan`s for `moe_ffn`."""

from pallas_moe.routing.aux import (
    load_balancing_loss,
    router_z_loss,
    routing_stats,
    stats_from_counts,
    token_choice_counts,
    update_selection_bias,
)
from pallas_moe.routing.plan import (
    DispatchPlan,
    TileSchedule,
    plan_from_assignment,
    tile_schedule,
    validate_plan,
)
from pallas_moe.routing.token_rounding import (
    ROUNDING_MODES,
    rounded_counts,
    token_rounding_assignment,
    token_rounding_plan,
)
from pallas_moe.routing.topk import SCORE_ORDERS, router_probabilities, topk_assignment, topk_plan

__all__ = [
    "DispatchPlan", "TileSchedule", "plan_from_assignment", "tile_schedule", "validate_plan",
    "topk_plan", "topk_assignment", "router_probabilities", "SCORE_ORDERS",
    "token_rounding_plan", "token_rounding_assignment", "rounded_counts", "ROUNDING_MODES",
    "load_balancing_loss", "router_z_loss", "update_selection_bias", "routing_stats",
    "stats_from_counts", "token_choice_counts",
]
