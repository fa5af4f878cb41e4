"""Expert parallelism (EP) for `pallas_moe.nn.MoE` with `jax.shard_map`.

Layout. Experts are sharded over one mesh axis (`ExpertParallel.axis`, size G): shard g
holds experts `[g*E/G, (g+1)*E/G)` of `w_gate_up [E, d, 2n]` and `w_down [E, n, d]`.
Tokens are sharded over `token_axes` (default: every mesh axis, so data-parallel axes and
the expert axis together split the batch). The router and the selection bias are
replicated. Every shard routes its own tokens over all E experts; dispatch and combine
move rows to the shards that own the experts, where the same `pm.moe_ffn` (the Pallas
kernels on GPU) runs on the local experts only.

Dispatch modes:

* `"all_gather"`: all-gather the tokens of the expert-parallel group (`[G*T_l, d]`) and
  all-to-all the routing columns of each shard's experts; every shard builds a plan over
  all the group's tokens for its local experts, runs `moe_ffn` and `psum_scatter`s the
  partial outputs back. Each shard moves `~2 * T_l*G * d` elements (gather + reduce-scatter)
  whatever the routing, and the gathered tokens are an all-gather XLA overlaps well. It
  wins at small EP (G=2..4), large K relative to G (`K >= G`: about every token is needed
  on every shard anyway), and small T. It runs on every backend, CPU included.
* `"ragged_all_to_all"`: each shard gathers its routed rows (`[T_l*K, d]`, grouped by
  expert, hence by destination shard) and sends each destination only its rows with
  `jax.lax.ragged_all_to_all`; the receiver runs `moe_ffn` over the received rows
  (regrouped by local expert), and a second ragged all-to-all returns the expert outputs,
  which the source combines with the router weights in fp32. Each shard moves
  `~2 * T_l*K * d * (G-1)/G` elements, only the routed rows: it wins when `K < G` and at
  scale (large T, many shards). XLA:CPU has no ragged all-to-all; use a GPU or TPU.
  Its receive buffer is static: worst case `G * T_l * min(K, E/G)` rows by default
  (exact, never drops), or `capacity_factor * T_l * K` rows; rows past a receiver's
  capacity are dropped (lower source shards first served) and counted in
  `aux["capacity_dropped_rows"]`.
* `"emulated_ragged_all_to_all"`: the ragged path with the collective emulated by an
  all-gather (moves G times the bytes). It exists to test the ragged bookkeeping on CPU.

Token rounding across shards. Rounding is per expert over the *global* batch: each shard
computes its top-K choices, counts are `psum`med over the token shards, and every shard
rounds the same global counts (the same PRNG key for "stochastic"). An expert then keeps
or adds rows by a global ranking (top-K rows first, each part by router score, ties by
global token index). An expert deviates by less than one tile, so only the best `tile`
candidates of each shard can matter: shards all-gather those (`[E, tile]` scores per
shard), find the global threshold per expert, and select their own rows against it. The
result equals single-device token rounding over the whole batch exactly (same plan rows),
whatever the layout.

Aux terms are computed from sums over tokens that are `psum`med over the token shards, so
`aux` equals the single-device module's; outputs and gradients equal it up to summation
order (the all-gather path sums expert partials across shards in the compute dtype).

Numerics (`pm.Numerics`). The ragged dispatch returns each routed row's expert output `Y`
to its source, which sums a token's rows in ascending expert order in the aggregation
mode's rounding order (`ops.xla.aggregate_rows`), exactly as the single-device layer does:
its forward is bitwise the single-device one whenever the expert GEMMs give each row the
same bits whatever rows share its tile (true of the `xla` backend on CPU). The all-gather
dispatch sums each shard's local experts, rounds that partial to the compute dtype, and
reduce-scatters the partials: in "fp32" that adds roundings, and in the bf16 modes it
re-associates a token's sum once a shard after the token's first holds two or more of its
rows, so it is not bitwise across EP sizes in general.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_moe import _checks
from pallas_moe.nn import functional as F
from pallas_moe.numerics import Numerics
from pallas_moe.ops.moe_ffn import moe_ffn
from pallas_moe.ops.xla import aggregate_rows
from pallas_moe.routing.plan import plan_from_assignment
from pallas_moe.routing.token_rounding import rounded_counts
from pallas_moe.routing.topk import check_router_inputs, router_probabilities, topk_assignment

DISPATCHES = ("all_gather", "ragged_all_to_all", "emulated_ragged_all_to_all")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How to shard a `MoE` layer's experts over a mesh.

    Attributes:
      mesh: a `jax.sharding.Mesh` holding `axis`.
      axis: mesh axis the experts are sharded over (size G; `num_experts % G == 0`).
      dispatch: "all_gather", "ragged_all_to_all" (GPU/TPU) or "emulated_ragged_all_to_all"
        (testing); see the module docstring for when each wins.
      token_axes: mesh axes the token dimension is sharded over, major to minor; must
        include `axis`. Default: every axis of the mesh, in mesh order.
      capacity_factor: ragged dispatch only; receive buffer of `capacity_factor * T_l * K`
        rows per shard (None: the exact worst case, never drops).
    """

    mesh: jax.sharding.Mesh
    axis: str = "expert"
    dispatch: str = "all_gather"
    token_axes: tuple[str, ...] | None = None
    capacity_factor: float | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
        if self.axis not in self.mesh.axis_names:
            raise ValueError(
                f"axis={self.axis!r} is not an axis of the mesh (axes {self.mesh.axis_names})."
            )
        _checks.check_choice("dispatch", self.dispatch, DISPATCHES)
        token_axes = self.mesh.axis_names if self.token_axes is None else self.token_axes
        if isinstance(token_axes, str):
            token_axes = (token_axes,)
        token_axes = tuple(token_axes)
        for name in token_axes:
            if name not in self.mesh.axis_names:
                raise ValueError(
                    f"token_axes names {name!r}, which is not an axis of the mesh "
                    f"(axes {self.mesh.axis_names})."
                )
        if self.axis not in token_axes:
            raise ValueError(
                f"token_axes={token_axes} must include the expert axis {self.axis!r}: each "
                "expert shard routes its own tokens."
            )
        if len(set(token_axes)) != len(token_axes):
            raise ValueError(f"token_axes has a repeated axis: {token_axes}.")
        object.__setattr__(self, "token_axes", token_axes)
        if self.capacity_factor is not None:
            if self.dispatch == "all_gather":
                raise ValueError("capacity_factor applies to the ragged dispatch only, not 'all_gather'.")
            if not isinstance(self.capacity_factor, (int, float)) or self.capacity_factor <= 0:
                raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor!r}.")
        if self.dispatch == "ragged_all_to_all":
            platform = self.mesh.devices.flat[0].platform
            if platform == "cpu":
                raise ValueError(
                    "dispatch='ragged_all_to_all' needs a GPU or TPU mesh: XLA:CPU has no "
                    "ragged_all_to_all. Use dispatch='all_gather' (or "
                    "'emulated_ragged_all_to_all' to test the ragged path) on CPU."
                )

    @property
    def size(self) -> int:
        """G, the number of expert shards."""
        return self.mesh.shape[self.axis]

    @property
    def num_token_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.token_axes)

    def check_experts(self, num_experts: int) -> None:
        if num_experts % self.size:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the size {self.size} of the "
                f"expert mesh axis {self.axis!r}."
            )

    def receive_capacity(self, cfg: F.RouterConfig, tokens_per_shard: int) -> int:
        """Static rows of a shard's receive buffer in the ragged dispatch."""
        local_experts = cfg.num_experts // self.size
        worst = self.size * cfg.capacity(tokens_per_shard, local_experts)
        if self.capacity_factor is None:
            return worst
        wanted = math.ceil(self.capacity_factor * tokens_per_shard * cfg.top_k)
        return min(worst, max(8, -(-wanted // 8) * 8))


def expert_parallel_moe(
    x: jax.Array,
    router: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    cfg: F.RouterConfig,
    ep: ExpertParallel,
    *,
    bias: jax.Array | None = None,
    key: jax.Array | None = None,
    backend: str = "auto",
    numerics: Numerics = Numerics(),
) -> tuple[jax.Array, dict]:
    """The routed part of a MoE layer with experts sharded over `ep.axis`.

    Args:
      x: [T, d] tokens in the compute dtype (T divisible by the number of token shards).
      router: [d, E] router weights (used in fp32).
      w_gate_up: [E, d, 2n] and w_down: [E, n, d], in x's dtype.
      cfg: routing options.
      ep: the expert-parallel layout.
      bias: f32[E] selection bias (score="sigmoid") or None.
      key: PRNG key for rounding="stochastic".
      backend: `pm.moe_ffn` backend each shard runs its local experts with.
      numerics: `pm.Numerics` (router dtype, aggregation mode, SwiGLU fusion).

    Returns:
      (y [T, d] in x's dtype, aux dict as `functional.finish_aux`), equal to the
      single-device layer up to summation order.
    """
    num_tokens, _ = x.shape
    ep.check_experts(cfg.num_experts)
    shards = ep.num_token_shards
    if num_tokens % shards:
        raise ValueError(
            f"the number of tokens T={num_tokens} must be divisible by the {shards} token "
            f"shards of mesh axes {ep.token_axes}."
        )
    if cfg.rounding == "stochastic" and cfg.routing == "token_rounding" and key is None:
        raise ValueError("key must be a PRNG key for rounding='stochastic', got None.")
    extras = {}
    if bias is not None:
        extras["bias"] = bias
    if key is not None and cfg.routing == "token_rounding":
        extras["key"] = key
    token_spec = P(ep.token_axes, None)
    expert_spec = P(ep.axis, None, None)

    def body(x_l, router, w_gate_up_l, w_down_l, extras):
        return _shard_moe(
            x_l, router, w_gate_up_l, w_down_l, cfg, ep,
            bias=extras.get("bias"), key=extras.get("key"), backend=backend, numerics=numerics,
        )

    in_specs = (token_spec, P(), expert_spec, expert_spec, P())
    args = (x, router, w_gate_up, w_down, extras)
    explicit = jax.sharding.AxisType.Explicit in ep.mesh.axis_types
    if explicit:
        # Explicit-sharding meshes need the inputs laid out as the specs say (Auto ones let
        # shard_map reshard them); the output goes back to x's sharding, so the layer is
        # transparent to the caller's layout.
        x_sharding = jax.typeof(x).sharding
        if x_sharding.mesh.empty:  # x was not laid out on a mesh: give y back replicated
            x_sharding = jax.sharding.NamedSharding(ep.mesh, P())
        args = tuple(
            jax.tree.map(lambda a, s=spec: jax.sharding.reshard(a, jax.sharding.NamedSharding(ep.mesh, s)), arg)
            for arg, spec in zip(args, in_specs)
        )
    # check_vma=False: moe_ffn's internals (scan carries, Pallas calls) carry no varying-axis
    # annotations. Gradients still equal the single-device layer's (tests/ep_check.py).
    y, aux = jax.shard_map(
        body,
        mesh=ep.mesh,
        in_specs=in_specs,
        out_specs=(token_spec, P()),
        check_vma=False,
    )(*args)
    if explicit:
        y = jax.sharding.reshard(y, x_sharding)
    return y, aux


def _shard_moe(x_l, router, w_gate_up_l, w_down_l, cfg, ep, *, bias, key, backend, numerics):
    """Per-shard body: route local tokens, dispatch, local experts, combine. x_l [T_l, d]."""
    logits = F.router_logits(x_l, router, numerics.router_dtype)  # f32[T_l, E]
    if cfg.routing == "topk":
        selected, weights, tc_selected = F.route_assignment(logits, cfg, bias=bias)  # [T_l, E]
    else:
        selected, weights, tc_selected = distributed_token_rounding(
            logits, cfg, ep.token_axes, ep.num_token_shards, bias=bias, key=key
        )  # [T_l, E]
    sums = F.router_sums(logits, selected, tc_selected)
    if ep.dispatch == "all_gather":
        y_l = _all_gather_dispatch(
            x_l, selected, weights, tc_selected, w_gate_up_l, w_down_l, cfg, ep, backend, numerics
        )
        sums["capacity_dropped_rows"] = jnp.zeros((), jnp.int32)
    else:
        collective = (
            jax.lax.ragged_all_to_all if ep.dispatch == "ragged_all_to_all" else emulated_ragged_all_to_all
        )
        y_l, dropped = _ragged_dispatch(
            x_l, selected, weights, tc_selected, w_gate_up_l, w_down_l, cfg, ep, backend,
            collective, numerics,
        )
        sums["capacity_dropped_rows"] = dropped
    aux = F.finish_aux(sums, cfg, lambda v: jax.lax.psum(v, ep.token_axes))
    return y_l, aux


def _all_gather_dispatch(
    x_l, selected, weights, tc_selected, w_gate_up_l, w_down_l, cfg, ep, backend, numerics
):
    """All-gather tokens over the expert axis, run local experts, reduce-scatter. -> [T_l, d]."""
    num_shards = ep.size
    local_experts = cfg.num_experts // num_shards
    tokens_l = x_l.shape[0]

    def columns_of_this_shard(a):
        # [T_l, E] of every shard -> [G*T_l, E_l]: all the group's tokens, this shard's experts.
        a = a.reshape(tokens_l, num_shards, local_experts).transpose(1, 0, 2)  # [G(dst), T_l, E_l]
        a = jax.lax.all_to_all(a, ep.axis, 0, 0, tiled=True)  # [G(src), T_l, E_l]
        return a.reshape(num_shards * tokens_l, local_experts)

    # One int32 exchange carries both masks: bit 0 = routed, bit 1 = kept top-K row.
    code = selected.astype(jnp.int32) + 2 * (selected & tc_selected).astype(jnp.int32)  # [T_l, E]
    code_g = columns_of_this_shard(code)  # [G*T_l, E_l]
    weights_g = columns_of_this_shard(weights)  # f32[G*T_l, E_l]
    x_g = jax.lax.all_gather(x_l, ep.axis, axis=0, tiled=True)  # [G*T_l, d]
    plan = plan_from_assignment(
        (code_g & 1) > 0, weights_g, (code_g & 2) > 0,
        capacity=cfg.capacity(num_shards * tokens_l, local_experts),
    )
    y_g = moe_ffn(
        x_g, plan, w_gate_up_l, w_down_l, backend=backend, numerics=numerics
    )  # [G*T_l, d], local experts only
    return jax.lax.psum_scatter(y_g, ep.axis, scatter_dimension=0, tiled=True)  # [T_l, d]


def _exclusive_cumsum(a, axis):
    return jnp.cumsum(a, axis=axis, dtype=jnp.int32) - a


def _ragged_dispatch(
    x_l, selected, weights, tc_selected, w_gate_up_l, w_down_l, cfg, ep, backend, collective,
    numerics,
):
    """Send routed rows to their experts' shards, run local experts, send outputs back.

    Returns ([T_l, d] output, i32[] rows this shard could not send for lack of capacity).
    """
    num_shards = ep.size
    local_experts = cfg.num_experts // num_shards
    tokens_l, d = x_l.shape
    dtype = x_l.dtype
    me = jax.lax.axis_index(ep.axis)

    # Rows of this shard's tokens, grouped by expert, hence by destination shard.
    plan = plan_from_assignment(
        selected, weights, selected & tc_selected, capacity=cfg.capacity(tokens_l)
    )  # P_l rows
    counts = plan.group_sizes.reshape(num_shards, local_experts)  # [G(dst), E_l]
    all_counts = jax.lax.all_gather(counts, ep.axis)  # [G(src), G(dst), E_l]
    sizes = jnp.sum(all_counts, axis=-1, dtype=jnp.int32)  # [src, dst]
    receive_rows = ep.receive_capacity(cfg, tokens_l)
    # A receiver's buffer fills in source order; rows past its capacity are not sent.
    allowed = jnp.clip(receive_rows - _exclusive_cumsum(sizes, 0), 0, sizes)  # [src, dst]
    send_offsets = _exclusive_cumsum(sizes, 1)  # [src, dst] first row for dst in src's plan
    recv_offsets = _exclusive_cumsum(allowed, 0)  # [src, dst] first row from src in dst's buffer

    x_rows = x_l[plan.token_ids]  # [P_l, d]
    x_recv = collective(
        x_rows, jnp.zeros((receive_rows, d), dtype),
        send_offsets[me], allowed[me], recv_offsets[me], allowed[:, me], axis_name=ep.axis,
    )  # [R, d], source-major, expert-major inside a source

    # Local expert of each received row, from the counts every source sent.
    row = jnp.arange(receive_rows, dtype=jnp.int32)  # [R]
    from_src = allowed[:, me]  # [G(src)]
    num_received = jnp.sum(from_src)
    src = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(from_src), row, side="right"), num_shards - 1
    )  # [R]
    pos = row - recv_offsets[src, me]  # [R] position inside its source's chunk
    ends = jnp.cumsum(all_counts[:, me, :], axis=1, dtype=jnp.int32)  # [G(src), E_l]
    expert = jnp.sum(pos[:, None] >= ends[src], axis=1, dtype=jnp.int32)  # [R]
    received = (row < num_received)[:, None] & (
        expert[:, None] == jnp.arange(local_experts, dtype=jnp.int32)[None, :]
    )  # [R, E_l]
    # Each received row is its own "token" with weight 1: the router weight is applied by
    # the source at combine, so the expert output Y is what comes back.
    plan_recv = plan_from_assignment(
        received, jnp.ones(received.shape, jnp.float32), received, capacity=receive_rows
    )
    # Weight 1 and one row per "token": every aggregation mode returns Y itself.
    y_recv = moe_ffn(
        x_recv, plan_recv, w_gate_up_l, w_down_l, backend=backend, numerics=numerics
    )  # [R, d]

    y_rows = collective(
        y_recv, jnp.zeros((plan.capacity, d), dtype),
        recv_offsets[:, me], allowed[:, me], send_offsets[:, me], allowed[me], axis_name=ep.axis,
    )  # [P_l, d]; rows not served stay 0

    # Combine: O[t] = sum_r s[r] * Y[r] over the rows of token t, in ascending expert order
    # and the aggregation mode's roundings, as the single-device layer sums them. Top-K has
    # exactly K rows per token (no scatter); token rounding walks the row tiles.
    rows_per_token = cfg.top_k if cfg.routing == "topk" else None
    y_l = aggregate_rows(
        y_rows, plan, numerics.aggregation, rows_per_token=rows_per_token
    )  # f32 [T_l, d]
    dropped = jnp.sum(sizes[me]) - jnp.sum(allowed[me])
    return y_l.astype(dtype), dropped


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all` semantics built from `all_gather` (G times the bytes).

    For testing the ragged dispatch where the collective is missing (XLA:CPU).
    Differentiable in operand and output.
    """
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [G, N, ...]
    starts = jax.lax.all_gather(output_offsets, axis_name)[:, me]  # [G(src)] where src writes in me
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]  # [G(src)]
    src_starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [G(src)]
    row = jnp.arange(output.shape[0], dtype=jnp.int32)  # [M]
    hit = (row[None, :] >= starts[:, None]) & (row[None, :] < (starts + sizes)[:, None])  # [G, M]
    src = jnp.argmax(hit, axis=0)  # [M]
    src_row = jnp.clip(src_starts[src] + row - starts[src], 0, operand.shape[0] - 1)  # [M]
    values = operands[src, src_row]  # [M, ...]
    mask = jnp.any(hit, axis=0).reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(mask, values, output)


def distributed_token_rounding(
    logits: jax.Array,
    cfg: F.RouterConfig,
    token_axes: tuple[str, ...],
    num_shards: int,
    *,
    bias: jax.Array | None = None,
    key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token rounding over the global batch, from inside `shard_map` (tokens sharded).

    Equals `pm.routing.token_rounding_assignment` on the concatenated logits, restricted to
    this shard's tokens.

    Args:
      logits: f32[T_l, E] this shard's router logits.
      cfg: routing options (routing="token_rounding").
      token_axes: mesh axes the tokens are sharded over (major to minor).
      num_shards: static product of their sizes.
      bias, key: selection bias and stochastic-rounding key, as in token rounding.

    Returns:
      (selected bool[T_l, E], weights f32[T_l, E], tc_selected bool[T_l, E]).
    """
    k = check_router_inputs(logits, cfg.top_k, cfg.score, bias)
    tokens_l = logits.shape[0]
    tc_selected, tc_weights = topk_assignment(
        logits, k, score=cfg.score, renormalize=cfg.renormalize, bias=bias
    )  # [T_l, E]
    probs = router_probabilities(logits, cfg.score)  # [T_l, E]
    rank_score = probs if bias is None else probs + bias.astype(jnp.float32)[None, :]
    global_token = jax.lax.axis_index(token_axes) * tokens_l + jnp.arange(tokens_l, dtype=jnp.int32)

    counts = jax.lax.psum(jnp.sum(tc_selected, axis=0, dtype=jnp.int32), token_axes)  # [E] global
    target = rounded_counts(
        counts, cfg.tile, cfg.rounding, max_count=tokens_l * num_shards, key=key
    )  # [E]
    num_add = jnp.maximum(target - counts, 0)  # [E], < tile
    num_drop = jnp.maximum(counts - target, 0)  # [E], < tile
    # Add the best non-top-K tokens: ascending (-score, token).
    added = _first_m_global(-rank_score, global_token, ~tc_selected, num_add, cfg.tile, token_axes)
    # Drop the worst top-K rows: the first in ascending (score, -token).
    dropped = _first_m_global(rank_score, -global_token, tc_selected, num_drop, cfg.tile, token_axes)
    selected = (tc_selected & ~dropped) | added  # [T_l, E]
    weights = jnp.where(selected, jnp.where(tc_selected, tc_weights, probs), 0.0)
    return selected, weights, tc_selected


def _first_m_global(primary, secondary, eligible, m, tile, token_axes):
    """bool[T_l, E]: eligible entries among the first `m[e]` of expert e's global order.

    The order is ascending (primary, secondary) over the eligible entries of all token
    shards. `m < tile`, so each shard's best `tile` candidates per expert decide it.

    Args:
      primary: f32[T_l, E]; secondary: i32[T_l] (unique per global token);
      eligible: bool[T_l, E]; m: i32[E]; tile: static bound on m.
    """
    tokens_l = primary.shape[0]
    keep = min(tile, tokens_l)
    ineligible = (~eligible).astype(jnp.int32)  # [T_l, E]
    p = jnp.where(eligible, primary, jnp.inf)  # [T_l, E]
    q = jnp.where(eligible, secondary[:, None], jnp.iinfo(jnp.int32).max)  # [T_l, E]
    local = jax.lax.sort((ineligible.T, p.T, q.T), dimension=1, num_keys=3)  # 3 x [E, T_l]
    candidates = [jax.lax.all_gather(a[:, :keep], token_axes, axis=1, tiled=True) for a in local]
    g_inel, g_p, g_q = jax.lax.sort(tuple(candidates), dimension=1, num_keys=3)  # [E, S*keep]
    idx = jnp.clip(m - 1, 0, g_p.shape[1] - 1)[:, None]  # [E, 1]
    th_p = jnp.take_along_axis(g_p, idx, axis=1)[:, 0]  # [E] key of the m-th entry
    th_q = jnp.take_along_axis(g_q, idx, axis=1)[:, 0]  # [E]
    at_or_before = (p < th_p[None, :]) | ((p == th_p[None, :]) & (q <= th_q[None, :]))  # [T_l, E]
    return eligible & (m[None, :] > 0) & at_or_before
