"""Pure functions behind `pallas_moe.nn.MoE`: router config, routing, aux terms, SwiGLU MLP.

The module (`moe.py`) and expert parallelism (`expert_parallel.py`) share these, so the
single-device and the sharded layer compute the same formulas. Aux terms are computed from
*sufficient statistics* (sums over tokens); the sharded layer `psum`s those sums over the
token shards before finishing them, which makes its aux pytree equal the single-device one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.numerics import round_bf16
from pallas_moe.ops.xla import swiglu
from pallas_moe.routing.aux import stats_from_counts
from pallas_moe.routing.plan import DispatchPlan
from pallas_moe.routing.token_rounding import (
    ROUNDING_MODES, token_rounding_assignment, token_rounding_plan_and_counts,
)
from pallas_moe.routing.topk import (
    SCORE_ORDERS, check_groups, check_router_inputs, topk_assignment, topk_plan,
)

ROUTINGS = ("topk", "token_rounding")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Static routing options of one MoE layer (hashable; safe as a jit static argument).

    Attributes:
      num_experts: E.
      top_k: K, experts per token (token-choice step).
      routing: "topk" (plain token choice) or "token_rounding" (counts rounded to `tile`).
      score: "softmax_topk" | "topk_softmax" | "sigmoid" (see `pm.routing.topk_plan`).
      renormalize: rescale each token's K weights to sum to 1 (softmax_topk, sigmoid).
      tile: GEMM tile height; token rounding rounds counts to multiples of it, and the
        routing stats count padding waste against it.
      rounding: token-rounding mode ("nearest", "up", "down", "stochastic", "balance").
      load_balance_weight: weight of the Switch load-balancing loss in `aux["loss"]`.
      z_loss_weight: weight of the router z-loss in `aux["loss"]`.
      num_groups, topk_groups: grouped top-K (DeepSeek-V3 `n_group` / `topk_group`; see
        `pm.routing.topk_assignment`); routing="topk" only. None: plain top-K.
      routed_scaling_factor: every routed weight is multiplied by it after renormalization
        (DeepSeek-V3's `routed_scaling_factor`).
    """

    num_experts: int
    top_k: int
    routing: str = "topk"
    score: str = "softmax_topk"
    renormalize: bool = False
    tile: int = 128
    rounding: str = "nearest"
    load_balance_weight: float = 1e-2
    z_loss_weight: float = 1e-3
    num_groups: int | None = None
    topk_groups: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        _checks.check_positive_int("num_experts", self.num_experts)
        _checks.check_positive_int("top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} must be <= num_experts={self.num_experts}."
            )
        _checks.check_choice("routing", self.routing, ROUTINGS)
        _checks.check_choice("score", self.score, SCORE_ORDERS)
        _checks.check_positive_int("tile", self.tile)
        _checks.check_choice("rounding", self.rounding, ROUNDING_MODES)
        for name in ("load_balance_weight", "z_loss_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative number (finite), got {value!r}.")
        check_groups(self.num_experts, self.top_k, self.num_groups, self.topk_groups)
        if self.num_groups is not None and self.routing != "topk":
            raise ValueError(
                f"num_groups/topk_groups (grouped top-K) need routing='topk', got routing={self.routing!r}."
            )
        factor = self.routed_scaling_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0 < factor < float("inf")):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {factor!r}.")

    def scale_weights(self, weights: jax.Array) -> jax.Array:
        """Routed weights times `routed_scaling_factor` (a no-op at 1)."""
        return weights if self.routed_scaling_factor == 1 else weights * self.routed_scaling_factor

    def capacity(self, num_tokens: int, num_experts: int | None = None) -> int:
        """Static row capacity of a plan over `num_tokens` tokens and `num_experts` experts.

        `num_experts` defaults to E; pass a smaller count for a plan over a subset of the
        experts (a shard's local experts), where a token holds at most min(K, E_sub) top-K rows.
        """
        num_experts = self.num_experts if num_experts is None else num_experts
        rows = num_tokens * min(self.top_k, num_experts)
        if self.routing == "token_rounding":
            rows += num_experts * self.tile  # each expert deviates by less than one tile
        return min(rows, num_tokens * num_experts)


def router_logits(
    x: jax.Array, router: jax.Array, bias: jax.Array | None = None, *, dtype: str = "float32"
) -> jax.Array:
    """f32[T, E] router logits `x @ router (+ bias)` of x [T, d], router [d, E], bias [E].

    `dtype` is `Numerics.router_dtype`: "float32" multiplies fp32 inputs with fp32
    accumulation; "bfloat16" is a bf16 linear layer (`bf16_linear`: inputs rounded to bf16,
    fp32 accumulation, logits rounded to bf16, and its backward as a bf16 layer's: the
    logits' gradient rounded to bf16), returned as f32. The bias is added in fp32.
    """
    if dtype == "float32":
        logits = jnp.dot(
            x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
    elif dtype == "bfloat16":
        logits = bf16_linear(x, router)
    else:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}.")
    return logits if bias is None else logits + bias.astype(jnp.float32)


@jax.custom_vjp
def bf16_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """f32[T, E] `x @ w` of x [T, d] and w [d, E] as a bf16 linear layer computes it: both
    rounded to bf16, the product accumulated in fp32 and rounded to bf16.

    Its backward is the layer's as engines run it (PyTorch autograd through `F.linear` on
    bf16 tensors): the output gradient g is rounded to bf16, then `dx = g @ w^T` (written in
    x's dtype) and `dw = x^T @ g` (fp32, cast to w's dtype) are GEMMs of bf16 operands with
    fp32 accumulation. Measured on the H100 (benchmarks/RESULTS.md, session 15): the
    router's three GEMMs took 178 -> 106 us of a 7B layer step and 586 -> 307 us at 30B
    against a plain `jnp.dot`, whose fp32 gradient (straight through the rounding) made
    XLA multiply in fp32 and write dx as fp32 [T, d]. Reverse mode only (`jax.jvp` raises).
    """
    return round_bf16(jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                              preferred_element_type=jnp.float32))


def _bf16_linear_fwd(x, w):
    return bf16_linear(x, w), (x, w)


def _bf16_linear_bwd(residuals, grad):
    x, w = residuals
    g = grad.astype(jnp.bfloat16)  # [T, E]
    dx = jnp.dot(g, w.astype(jnp.bfloat16).T, preferred_element_type=x.dtype)  # [T, d]
    dw = jnp.dot(x.astype(jnp.bfloat16).T, g, preferred_element_type=jnp.float32)  # [d, E]
    return dx, dw.astype(w.dtype)


bf16_linear.defvjp(_bf16_linear_fwd, _bf16_linear_bwd)


def route_assignment(
    logits: jax.Array,
    cfg: RouterConfig,
    *,
    bias: jax.Array | None = None,
    key: jax.Array | None = None,
    check_finite: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routes logits [T, E] to a dense assignment (single device / one routing group).

    `check_finite` is the NaN/Inf check mode of the bias and logits (see `pm.routing.topk_plan`).

    Returns:
      (selected bool[T, E], weights f32[T, E], tc_selected bool[T, E]): the routed pairs,
      their router weights (differentiable in logits, times `cfg.routed_scaling_factor`),
      and the plain top-K (token-choice) pairs. For top-K routing `selected == tc_selected`.
    """
    check_router_inputs(logits, cfg.top_k, cfg.score, bias, check_finite)
    if cfg.routing == "topk":
        selected, weights = topk_assignment(
            logits, cfg.top_k, score=cfg.score, renormalize=cfg.renormalize, bias=bias,
            num_groups=cfg.num_groups, topk_groups=cfg.topk_groups,
        )
        return selected, cfg.scale_weights(weights), selected
    if cfg.rounding == "stochastic" and key is None:
        raise ValueError("key must be a PRNG key for rounding='stochastic', got None.")
    selected, weights, tc_selected = token_rounding_assignment(
        logits, cfg.top_k, tile=cfg.tile, rounding=cfg.rounding, key=key,
        score=cfg.score, renormalize=cfg.renormalize, bias=bias,
    )
    return selected, cfg.scale_weights(weights), tc_selected


def route(
    logits: jax.Array,
    cfg: RouterConfig,
    *,
    bias: jax.Array | None = None,
    key: jax.Array | None = None,
    check_finite: bool | None = None,
    impl: str = "auto",
) -> tuple[DispatchPlan, dict[str, jax.Array]]:
    """Routes logits [T, E] to a `DispatchPlan` (single device / one routing group).

    The plans of `pm.routing.topk_plan` / `token_rounding_plan`, built by their fast path
    where `impl="auto"` picks it (the routing kernel on GPU), which never builds a dense
    [T, E] assignment; `impl` ("auto", "kernel", "interpret", "sort", "dense") is theirs.
    Every impl gives the same plan, counts and gradients to the logits, bitwise.

    Returns:
      (plan, counts): counts holds i32[E] "counts" (rows per expert in the plan),
      "tc_counts" (plain top-K rows per expert) and "kept_tc_counts" (top-K rows the plan
      kept), as `router_sums` takes them.
    """
    if cfg.routing == "topk":
        plan = topk_plan(
            logits, cfg.top_k, score=cfg.score, renormalize=cfg.renormalize, bias=bias,
            num_groups=cfg.num_groups, topk_groups=cfg.topk_groups, check_finite=check_finite,
            impl=impl,
        )
        plan = plan.with_scores(cfg.scale_weights(plan.scores))
        counts = plan.group_sizes
        return plan, {"counts": counts, "tc_counts": counts, "kept_tc_counts": counts}
    plan, tc_counts = token_rounding_plan_and_counts(
        logits, cfg.top_k, tile=cfg.tile, rounding=cfg.rounding, key=key, score=cfg.score,
        renormalize=cfg.renormalize, bias=bias, check_finite=check_finite, impl=impl,
    )
    plan = plan.with_scores(cfg.scale_weights(plan.scores))
    counts = plan.group_sizes
    # An expert either adds rows (keeping all its top-K rows) or drops some: it keeps
    # min(count, tc_count) of them.
    return plan, {
        "counts": counts, "tc_counts": tc_counts, "kept_tc_counts": jnp.minimum(counts, tc_counts),
    }


def assignment_counts(selected: jax.Array, tc_selected: jax.Array) -> dict[str, jax.Array]:
    """Per-expert counts of a dense assignment (selected, tc_selected: bool[T, E])."""
    return {
        "counts": jnp.sum(selected, axis=0, dtype=jnp.int32),  # [E]
        "tc_counts": jnp.sum(tc_selected, axis=0, dtype=jnp.int32),  # [E]
        "kept_tc_counts": jnp.sum(selected & tc_selected, axis=0, dtype=jnp.int32),  # [E]
    }


def router_sums(logits: jax.Array, counts: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums over the tokens of one shard that the aux terms are finished from.

    Args:
      logits: f32[T, E]; counts: the per-expert counts returned by `route` (or
        `assignment_counts`).

    Returns:
      num_tokens f32[], prob_sum f32[E] (full-softmax router probability summed over tokens,
      differentiable), lse_sq_sum f32[] (sum of logsumexp^2, differentiable), counts i32[E]
      (routed rows per expert), tc_counts i32[E] (plain top-K rows per expert), kept_tc_counts
      i32[E] (top-K rows that stayed in the plan), nonfinite_tokens i32[] (tokens whose
      logits hold NaN/Inf: an on-device flag, read after the step, no host callback).
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)  # [T, E]
    return {
        "num_tokens": jnp.asarray(logits.shape[0], jnp.float32),
        "prob_sum": jnp.sum(probs, axis=0),  # [E]
        "lse_sq_sum": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
        **counts,
        "nonfinite_tokens": jnp.sum(
            jnp.logical_not(jnp.all(jnp.isfinite(logits), axis=-1)), dtype=jnp.int32
        ),
    }


def finish_aux(
    sums: dict[str, jax.Array],
    cfg: RouterConfig,
    reduce: Callable[[jax.Array], jax.Array] = lambda v: v,
) -> dict[str, jax.Array]:
    """Aux pytree of one layer from `router_sums` (after `reduce`, e.g. a psum over shards).

    The formulas are those of `pm.routing.load_balancing_loss`, `router_z_loss` and
    `routing_stats`.

    Returns a dict of scalars and [E] vectors:
      loss: f32[] weighted total, `load_balance_weight * load_balance_loss + z_loss_weight * z_loss`.
      load_balance_loss: f32[] `E * sum_e f_e * p_e` (1 under perfect balance).
      z_loss: f32[] mean over tokens of logsumexp(logits)^2.
      counts: i32[E] rows per expert in the plan; tc_counts: i32[E] plain top-K rows per
      expert (what the selection bias balances).
      dropped_rows, added_rows: i32[] top-K rows token rounding dropped / non-top-K rows it added.
      padding_rows, padding_fraction: rows a grouped GEMM with `tile`-row tiles pads, and the
      fraction of padded rows; tc_padding_rows, tc_padding_fraction: the same for plain top-K.
      max_load: f32[] max count over mean count.
      capacity_dropped_rows: i32[] rows the ragged expert-parallel dispatch could not send for
      lack of receive capacity (0 elsewhere; see `ExpertParallel.capacity_factor`).
      nonfinite_tokens: i32[] tokens whose router logits hold NaN/Inf (from x or the router);
      0 in a healthy step. Check it after the step: no host callback inside it.
    """
    sums = {name: reduce(value) for name, value in sums.items()}
    num_tokens = sums["num_tokens"]
    k, e, tile = cfg.top_k, cfg.num_experts, cfg.tile
    fraction = sums["kept_tc_counts"].astype(jnp.float32) / (num_tokens * k)  # [E]
    mean_prob = sums["prob_sum"] / num_tokens  # [E]
    load_balance = e * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)
    z_loss = sums["lse_sq_sum"] / num_tokens
    stats = stats_from_counts(sums["counts"], sums["tc_counts"], sums["kept_tc_counts"], tile)
    return {
        "loss": cfg.load_balance_weight * load_balance + cfg.z_loss_weight * z_loss,
        "load_balance_loss": load_balance,
        "z_loss": z_loss,
        "tc_counts": sums["tc_counts"],
        **stats,
        "capacity_dropped_rows": sums.get("capacity_dropped_rows", jnp.zeros((), jnp.int32)),
        "nonfinite_tokens": sums["nonfinite_tokens"],
    }


def shared_mlp(
    x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, w_gate: jax.Array | None = None
) -> jax.Array:
    """The shared experts: `swiglu_mlp(x)`, scaled by `sigmoid(x @ w_gate)` when a gate
    `w_gate` f32[d, 1] is given (Qwen2-MoE's `shared_expert_gate`). Returns [T, d] in x.dtype."""
    y = swiglu_mlp(x, w_gate_up, w_down)  # [T, d]
    if w_gate is None:
        return y
    gate = jax.nn.sigmoid(router_logits(x, w_gate))  # f32[T, 1]
    return (gate * y.astype(jnp.float32)).astype(x.dtype)


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Dense SwiGLU MLP (the shared experts): x [T, d], w_gate_up [d, 2m], w_down [m, d].

    fp32 accumulation; the hidden activation is rounded to x.dtype as in `moe_ffn`.
    Returns [T, d] in x.dtype.
    """
    h = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32).astype(x.dtype)  # [T, 2m]
    a = swiglu(h).astype(x.dtype)  # [T, m]
    return jnp.dot(a, w_down, preferred_element_type=jnp.float32).astype(x.dtype)  # [T, d]
