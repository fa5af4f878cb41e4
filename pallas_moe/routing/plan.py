"""The dispatch plan: how routed (token, expert, score) rows are laid out for the kernels.

Every backend of `pm.moe_ffn` consumes a `DispatchPlan`. Rows are grouped by expert
(rows `[off[e], off[e+1])` belong to expert `e`), stable by token inside a group.
Rows past `sum(group_sizes)` are padding: token 0, score 0, and no expert owns them,
so every kernel skips them.

For a deterministic aggregation (`O[t] = sum_r s[r] * Y[r]` in ascending expert order),
the plan also holds each token's rows in CSR form: the grouped rows of token `t` are
`rows_by_token[token_row_offsets[t]:token_row_offsets[t + 1]]`, in ascending expert order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_moe import _checks


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "token_ids",
        "scores",
        "group_sizes",
        "is_token_choice",
        "rows_by_token",
        "token_row_offsets",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Routed rows grouped by expert. `P` is the static row capacity, `T` tokens, `E` experts.

    Attributes:
      token_ids: i32[P]. Source token of each grouped row; 0 on padding rows.
      scores: f32[P]. Router weight of each row; 0 on padding rows. Differentiable.
      group_sizes: i32[E]. Rows per expert; `sum(group_sizes) <= P`.
      is_token_choice: bool[P]. True for rows chosen by token-choice top-K; False for
        rows that token rounding added, and for padding.
      rows_by_token: i32[P]. Grouped-row indices ordered by (token, expert); padding last.
      token_row_offsets: i32[T + 1]. CSR offsets into `rows_by_token` per token.
    """

    token_ids: jax.Array
    scores: jax.Array
    group_sizes: jax.Array
    is_token_choice: jax.Array
    rows_by_token: jax.Array
    token_row_offsets: jax.Array

    @property
    def capacity(self) -> int:
        """Static row capacity `P` (`T*K` for top-K, `T*K + E*tile` for token rounding)."""
        return self.token_ids.shape[0]

    @property
    def num_experts(self) -> int:
        return self.group_sizes.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_row_offsets.shape[0] - 1

    @property
    def num_rows(self) -> jax.Array:
        """i32[] number of real (non-padding) rows."""
        return jnp.sum(self.group_sizes)

    @property
    def group_offsets(self) -> jax.Array:
        """i32[E + 1] start row of each expert's group, then the number of real rows."""
        return jnp.concatenate(
            [jnp.zeros((1,), jnp.int32), jnp.cumsum(self.group_sizes, dtype=jnp.int32)]
        )

    @property
    def row_is_valid(self) -> jax.Array:
        """bool[P] True for real rows, False for padding."""
        return jnp.arange(self.capacity, dtype=jnp.int32) < self.num_rows

    @property
    def expert_ids(self) -> jax.Array:
        """i32[P] expert of each row; `E` on padding rows."""
        rows = jnp.arange(self.capacity, dtype=jnp.int32)
        return count_at_most(self.group_offsets[1:], rows)

    @property
    def rows_per_token(self) -> jax.Array:
        """i32[T] number of rows of each token."""
        return jnp.diff(self.token_row_offsets)

    def with_scores(self, scores: jax.Array) -> "DispatchPlan":
        return dataclasses.replace(self, scores=scores)


def plan_from_assignment(
    selected: jax.Array, weights: jax.Array, token_choice: jax.Array, capacity: int
) -> DispatchPlan:
    """Builds a plan from a dense assignment. Shared by top-K and token rounding.

    Args:
      selected: bool[T, E]. Whether token t is routed to expert e. At most `capacity` True.
      weights: f32[T, E]. Router weight of each (token, expert); used where selected.
      token_choice: bool[T, E]. Whether the (token, expert) pair was a top-K choice.
      capacity: static row capacity P.

    Returns:
      A `DispatchPlan` with rows grouped by expert, stable by token.
    """
    num_tokens, num_experts = selected.shape
    sel = selected.astype(jnp.int32)  # [T, E]
    group_sizes = jnp.sum(sel, axis=0, dtype=jnp.int32)  # [E]
    group_starts = jnp.cumsum(group_sizes, dtype=jnp.int32) - group_sizes  # [E]
    # Grouped row of each selected pair: its group's start plus its rank by token in the group.
    row_of_pair = group_starts[None, :] + jnp.cumsum(sel, axis=0, dtype=jnp.int32) - 1  # [T, E]
    row_of_pair = jnp.where(selected, row_of_pair, capacity)  # unselected -> dropped by scatter

    flat_rows = row_of_pair.reshape(-1)  # [T*E], token-major, so (token, ascending expert)
    token_of_pair = jnp.broadcast_to(
        jnp.arange(num_tokens, dtype=jnp.int32)[:, None], (num_tokens, num_experts)
    ).reshape(-1)
    token_ids = jnp.zeros((capacity,), jnp.int32).at[flat_rows].set(token_of_pair, mode="drop")
    scores = (
        jnp.zeros((capacity,), jnp.float32)
        .at[flat_rows]
        .set(weights.astype(jnp.float32).reshape(-1), mode="drop")
    )
    is_token_choice = (
        jnp.zeros((capacity,), bool).at[flat_rows].set(token_choice.reshape(-1), mode="drop")
    )

    # CSR over tokens: position of each selected pair in token-major order.
    rows_per_token = jnp.sum(sel, axis=1, dtype=jnp.int32)  # [T]
    token_row_offsets = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(rows_per_token, dtype=jnp.int32)]
    )  # [T+1]
    csr_pos = jnp.cumsum(sel.reshape(-1), dtype=jnp.int32) - 1  # [T*E]
    csr_pos = jnp.where(selected.reshape(-1), csr_pos, capacity)
    num_rows = token_row_offsets[-1]
    # Padding slots of rows_by_token point at the padding rows themselves, in order.
    padding_rows = jnp.arange(capacity, dtype=jnp.int32)
    rows_by_token = padding_rows.at[csr_pos].set(flat_rows, mode="drop")
    rows_by_token = jnp.where(padding_rows < num_rows, rows_by_token, padding_rows)

    return DispatchPlan(
        token_ids=token_ids,
        scores=scores,
        group_sizes=group_sizes,
        is_token_choice=is_token_choice,
        rows_by_token=rows_by_token,
        token_row_offsets=token_row_offsets,
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["expert", "row_start", "row_end"],
    meta_fields=["block_m"],
)
@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """Row tiles of `block_m` rows, each inside one expert's group.

    Computed once per plan and block size; kernels and the `xla` backend walk these tiles
    instead of looping over all experts in every tile. Tile `i` covers grouped rows
    `[row_start[i], row_end[i])` of expert `expert[i]`; `row_end - row_start <= block_m`.
    Tiles past the real ones have `row_start == row_end` (empty) and repeat the last expert,
    so a kernel that walks them does no work and reloads no weights.

    Attributes:
      expert: i32[num_tiles]
      row_start: i32[num_tiles]
      row_end: i32[num_tiles]
      block_m: static tile height.
    """

    expert: jax.Array
    row_start: jax.Array
    row_end: jax.Array
    block_m: int

    @property
    def max_tiles(self) -> int:
        return self.expert.shape[0]


def max_tiles(capacity: int, num_experts: int, block_m: int) -> int:
    """Static bound on `sum_e ceil(g_e / block_m)` given `sum_e g_e <= capacity`."""
    return capacity // block_m + num_experts


def count_at_most(ends: jax.Array, values: jax.Array) -> jax.Array:
    """i32[N]: entries of `ends` (i32[E], ascending) that are <= each of `values` (i32[N]);
    `jnp.searchsorted(ends, values, side="right")`.

    By comparing every pair in one fused reduction (`method="compare_all"`, O(N * E)), not
    by the default binary search, which is a loop of small kernels: on the H100 the tile
    schedule of a T=64 plan took ~25 us of GPU time that way. The schedules search a few
    thousand tiles in at most a few hundred experts, a few million compares;
    `DispatchPlan.expert_ids` searches every row (`P * E`: 33M compares at T=32768, K=8,
    E=128, one pass with no memory traffic, against log2(E) dependent gathers over [P]).
    """
    return jnp.searchsorted(ends, values, side="right", method="compare_all").astype(jnp.int32)


def tile_schedule(group_sizes: jax.Array, capacity: int, block_m: int) -> TileSchedule:
    """Splits each expert's group into tiles of at most `block_m` rows.

    Args:
      group_sizes: i32[E] rows per expert.
      capacity: static row capacity P of the plan.
      block_m: static tile height.

    Returns:
      A `TileSchedule` with `max_tiles(capacity, E, block_m)` entries; zero-row experts get no tile.
    """
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    num_experts = group_sizes.shape[0]
    n_tiles = max_tiles(capacity, num_experts, block_m)
    group_sizes = group_sizes.astype(jnp.int32)
    tiles_per_expert = (group_sizes + block_m - 1) // block_m  # [E]
    tile_ends = jnp.cumsum(tiles_per_expert, dtype=jnp.int32)  # [E]
    tile_ids = jnp.arange(n_tiles, dtype=jnp.int32)
    total = tile_ends[-1]
    is_real = tile_ids < total
    # Expert owning each tile; tiles past the last real one take the last real tile's
    # expert, the last nonempty one (expert 0 when there is no row at all).
    expert = count_at_most(tile_ends, jnp.minimum(tile_ids, total - 1))
    group_ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    group_starts = group_ends - group_sizes
    first_tile_of_expert = tile_ends - tiles_per_expert
    local = tile_ids - first_tile_of_expert[expert]
    row_start = group_starts[expert] + local * block_m
    row_end = jnp.minimum(row_start + block_m, group_ends[expert])
    num_rows = group_ends[-1]
    row_start = jnp.where(is_real, row_start, num_rows)
    row_end = jnp.where(is_real, row_end, num_rows)
    return TileSchedule(expert=expert, row_start=row_start, row_end=row_end, block_m=block_m)


def validate_plan(plan: DispatchPlan, num_tokens: int) -> None:
    """Checks a (hand-built) plan against the layout every `moe_ffn` backend relies on.

    The backends trust the plan: an out-of-range token id is clamped by a gather and
    dropped by a scatter, so a malformed plan gives wrong numbers without an error. Call
    this on plans not made by `topk_plan` / `token_rounding_plan`, or pass
    `pm.moe_ffn(..., validate=True)`.

    Structure (shapes, dtypes, `num_tokens`) is checked at once. Values are checked eagerly
    (a `ValueError` naming the field) or, under `jit`, through `jax.experimental.checkify`
    (wrap the jitted function in `checkify.checkify` and call `err.throw()`).

    Checked: `group_sizes >= 0` and `sum(group_sizes) <= P`; real rows' token ids in
    `[0, T)` and scores finite; padding rows hold token 0 and score 0; `token_row_offsets`
    starts at 0, never decreases and ends at `sum(group_sizes)`; `rows_by_token` lists every
    real row once, each under its own token, a token's rows in strictly ascending expert
    order, and its padding slots point at themselves.

    Args:
      plan: the `DispatchPlan` to check.
      num_tokens: T, the number of tokens of the `x` it will be applied to.
    """
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a pallas_moe.routing.DispatchPlan, got {type(plan).__name__}.")
    num_tokens = _checks.check_positive_int("num_tokens", num_tokens)
    capacity = plan.capacity
    for name, ndim_shape, kind in (
        ("token_ids", (capacity,), "integer"),
        ("scores", (capacity,), "floating"),
        ("group_sizes", None, "integer"),
        ("is_token_choice", (capacity,), "bool"),
        ("rows_by_token", (capacity,), "integer"),
        ("token_row_offsets", (num_tokens + 1,), "integer"),
    ):
        value = getattr(plan, name)
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"plan.{name} must be an array, got {type(value).__name__}.")
        if ndim_shape is None and value.ndim != 1:
            raise ValueError(f"plan.group_sizes must be [E], got shape {tuple(value.shape)}.")
        if ndim_shape is not None and tuple(value.shape) != ndim_shape:
            hint = " (T + 1, with T from num_tokens)" if name == "token_row_offsets" else " ([P], as token_ids)"
            raise ValueError(f"plan.{name} must have shape {ndim_shape}{hint}, got {tuple(value.shape)}.")
        dtype_kind = {"integer": jnp.integer, "floating": jnp.floating, "bool": jnp.bool_}[kind]
        if not jnp.issubdtype(value.dtype, dtype_kind):
            raise TypeError(f"plan.{name} must be a {kind} array, got dtype {value.dtype}.")

    sizes = jnp.asarray(plan.group_sizes, jnp.int32)  # [E]
    num_rows = jnp.sum(sizes)
    row = jnp.arange(capacity, dtype=jnp.int32)  # [P], also the slots of rows_by_token
    real = row < num_rows  # [P]
    tok = jnp.asarray(plan.token_ids, jnp.int32)  # [P]
    scores = jnp.asarray(plan.scores)  # [P]
    require = _checks.require

    require(jnp.all(sizes >= 0), "plan.group_sizes must be >= 0, got a minimum of {low}.", low=jnp.min(sizes))
    require(
        num_rows <= capacity,
        f"plan.group_sizes sum to {{total}} rows, past the plan's row capacity P={capacity}.",
        total=num_rows,
    )
    count = jnp.sum(real & ((tok < 0) | (tok >= num_tokens)))
    require(
        count == 0, f"plan.token_ids: {{count}} real rows hold a token id outside [0, T={num_tokens}).",
        count=count,
    )
    count = jnp.sum(real & ~jnp.isfinite(scores))
    require(count == 0, "plan.scores: {count} real rows hold NaN or Inf.", count=count)
    count = jnp.sum(~real & ((tok != 0) | (scores != 0)))
    require(
        count == 0,
        "plan padding rows (past sum(group_sizes)) must hold token id 0 and score 0 in "
        "token_ids and scores; {count} do not.",
        count=count,
    )

    offsets = jnp.asarray(plan.token_row_offsets, jnp.int32)  # [T+1]
    decreases = jnp.sum(offsets[1:] < offsets[:-1])
    require(
        (offsets[0] == 0) & (decreases == 0) & (offsets[-1] == num_rows),
        "plan.token_row_offsets must start at 0, never decrease and end at sum(group_sizes)="
        "{total}; got first {first}, last {last} and {decreases} decreases.",
        total=num_rows, first=offsets[0], last=offsets[-1], decreases=decreases,
    )

    by_token = jnp.asarray(plan.rows_by_token, jnp.int32)  # [P]
    in_range = real & (by_token >= 0) & (by_token < num_rows)  # slot j < num_rows pointing at a real row
    times_listed = jnp.zeros((capacity + 1,), jnp.int32).at[jnp.where(in_range, by_token, capacity)].add(1)
    count = (
        jnp.sum(real & ~in_range)
        + jnp.sum(real & (times_listed[:capacity] != 1))
        + jnp.sum(~real & (by_token != row))
    )
    require(
        count == 0,
        "plan.rows_by_token must list every real row exactly once in its first sum(group_sizes) "
        "slots, and point each padding slot at itself; {count} slots or rows do not.",
        count=count,
    )
    token_of_slot = jnp.searchsorted(offsets[1:], row, side="right")  # [P]
    listed_row = jnp.where(in_range, by_token, 0)  # [P]
    count = jnp.sum(in_range & (tok[listed_row] != token_of_slot))
    require(
        count == 0,
        "plan.rows_by_token: {count} slots of a token (by token_row_offsets) point at rows of "
        "another token (by token_ids).",
        count=count,
    )
    expert = plan.expert_ids[listed_row]  # [P] expert of each slot's row
    same_token = (token_of_slot[1:] == token_of_slot[:-1]) & real[1:]  # [P-1]
    count = jnp.sum(same_token & (expert[1:] <= expert[:-1]))
    require(
        count == 0,
        "plan.rows_by_token: {count} rows of a token are not in strictly ascending expert "
        "order (a token meets each expert at most once, in ascending order).",
        count=count,
    )
