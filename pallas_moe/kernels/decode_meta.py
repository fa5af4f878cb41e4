"""The decode megakernel's per-plan metadata: a jnp reference and one small Pallas kernel.

The megakernel (`decode.py`) reads, per call, where each row tile of the plan starts, which
tokens its rows gather, which token blocks its down tasks notify and what each token
block's event must reach, and each CSR position's Y-slab row and router weight
(`DecodeMeta`). `decode_meta_reference` computes them in jnp: a handful of small XLA
fusions, ~7 us of GPU time and six launches at T = 1 on an H200 (session 33's profiles:
1.4 + 1.2 + 1.4 + 1.2 + 1.1 + 0.9 us), a quarter of the MoE kernel's own 31 us. At decode
sizes each of those kernels does almost nothing: the launch is the cost.

`impl="kernel"` computes the same arrays in one Pallas (Triton backend) program: the expert
prefix sums, then the tiles in chunks (expert, rows, token ids, token-block range and the
blocks' targets accumulated over the chunks), then the CSR positions in chunks (slab row and
weight). Every output is integer arithmetic or a copied weight, so it equals the reference
bit for bit (tested against it in interpret mode on CPU, and on the GPU by
`tests/test_gpu_decode.py`). Its work grows with the plan (`[tiles, E]` and `[P, E]`
compares in one program), so it is meant for decode sizes: the megakernel's default
(`DecodeConfig.meta_impl="auto"`) takes it for batches of at most `META_KERNEL_MAX_TOKENS`
tokens and the reference above. Measured on an H200 (session 41, the whole jitted call at
the Qwen3-30B-A3B widths): 42.0 against 50.8 us at T = 1, but 183.4 against 180.7 at T = 8
and 442.8 against 371.5 at T = 128.

The kernel's row tiles (expert, first row, rows and token ids of each tile of a chunk:
`load_groups`, `row_tile_prefix`, `row_tiles`) are `_common.tile_meta`'s; the
kernel-by-kernel forward's schedule kernel (`schedules.forward_schedules`,
`ForwardConfig.schedule_impl`) calls the same helpers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_moe.kernels._common import is_interpreted
from pallas_moe.numerics import multiplied_scores
from pallas_moe.routing.plan import tile_schedule

META_IMPLS = ("jnp", "kernel", "interpret")
# `meta_impl="auto"` runs the metadata kernel for batches of at most this many tokens (it
# won at T = 1 and lost at T = 8 on an H200, session 41).
META_KERNEL_MAX_TOKENS = 4


def resolve_meta_impl(meta_impl: str, num_tokens: int, *,
                      max_tokens: int = META_KERNEL_MAX_TOKENS, interpret=False) -> str:
    """A metadata implementation ("jnp", "kernel" or "auto") for a batch of `num_tokens`
    tokens: "auto" is "kernel" up to `max_tokens` tokens and "jnp" above; "kernel" is
    "interpret" where the kernels run interpreted (`interpret` True or an
    `InterpretGPUParams`). `DecodeConfig.meta_impl` (with `META_KERNEL_MAX_TOKENS`) and
    `ForwardConfig.schedule_impl` (`schedules.resolve_schedule_impl`) both resolve here."""
    impl = meta_impl
    if impl == "auto":
        impl = "kernel" if num_tokens <= max_tokens else "jnp"
    if impl == "kernel" and is_interpreted(interpret):
        impl = "interpret"
    return impl

# Tiles and CSR positions the kernel handles per loop step ([chunk, E] compares each).
TILE_CHUNK = 32
ROW_CHUNK = 128


def max_decode_tiles(capacity: int, num_experts: int, block_m: int) -> int:
    """Bound on the row tiles of a plan: each non-empty tile holds >= 1 row, and
    `sum_e ceil(g_e / block_m) <= capacity // block_m + E`."""
    return max(1, min(capacity, capacity // block_m + num_experts))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "counts", "expert", "row_start", "num_rows", "row_ids", "block_lo", "block_count",
        "block_target", "offsets", "agg_row", "agg_score",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DecodeMeta:
    """What the kernel reads per plan (computed once per call from the plan).

    Attributes (M = max tiles, B = token blocks, P = plan capacity):
      counts: i32[1] number of real (non-empty) tiles; they come first.
      expert, row_start, num_rows: i32[M] expert, first grouped row and rows of each tile.
      row_ids: i32[M, block_m] source token of each tile row; past the tile's rows
        `-1 - t`, with t the token of its last real row (0 for empty tiles): the cp.async
        gather zero-fills those rows without reading, the TMA gather copies row t (every
        copy in bounds). Why: at small T a tile is mostly padding, and padding rows that
        all read one token made every SM's gather hit the same L2 lines (session 32).
      block_lo, block_count: i32[M] the token blocks a tile's down tasks notify:
        [block_lo, block_lo + block_count) covers every block holding a token of the tile
        (0 blocks for empty tiles).
      block_target: i32[B] the value tok_done[b] reaches: down blocks per tile times the
        number of tiles whose range covers b.
      offsets: i32[T + 1] the plan's CSR offsets (rows of token t: [offsets[t], offsets[t+1])).
      agg_row: i32[P] Y-slab row of each CSR position (`tile * block_m + row in tile`).
      agg_score: f32[P] router weight of each CSR position, rounded for the aggregation mode.
    """

    counts: jax.Array
    expert: jax.Array
    row_start: jax.Array
    num_rows: jax.Array
    row_ids: jax.Array
    block_lo: jax.Array
    block_count: jax.Array
    block_target: jax.Array
    offsets: jax.Array
    agg_row: jax.Array
    agg_score: jax.Array


def decode_meta(plan, config, d: int, aggregation: str = "fp32", *, impl: str | None = None) -> DecodeMeta:
    """The per-plan metadata of the megakernel.

    Args:
      plan: the `DispatchPlan`.
      config: the `DecodeConfig` (its `block_m`, `token_block`, `down_block_n` and, unless
        `impl` is given, `meta_impl`).
      d: model width (the down tasks per tile are `d // config.down_block_n`).
      aggregation: the aggregation mode (`pallas_moe.numerics.AGGREGATIONS`); it rounds
        `agg_score`.
      impl: "jnp" (`decode_meta_reference`), "kernel" (one Pallas program, GPU) or
        "interpret" (that kernel in Pallas interpret mode, CPU); None: `config.meta_impl`
        for this plan's batch (`resolve_meta_impl`). All give the same arrays bit for bit.
    """
    impl = resolve_meta_impl(config.meta_impl, plan.num_tokens) if impl is None else impl
    if impl not in META_IMPLS:
        raise ValueError(f"impl must be one of {META_IMPLS}, got {impl!r}.")
    if impl == "jnp":
        return decode_meta_reference(plan, config, d, aggregation)
    return _decode_meta_kernel(plan, config, d, aggregation, interpret=impl == "interpret")


def decode_meta_reference(plan, config, d: int, aggregation: str = "fp32") -> DecodeMeta:
    """`decode_meta` in jnp (a handful of small fused XLA ops): the reference."""
    bm, bt = config.block_m, config.token_block
    capacity, num_experts, num_tokens = plan.capacity, plan.num_experts, plan.num_tokens
    max_tiles = max_decode_tiles(capacity, num_experts, bm)
    num_blocks = -(-num_tokens // bt)
    down_blocks = d // config.down_block_n
    sched = tile_schedule(plan.group_sizes, capacity, bm)
    num_rows = (sched.row_end - sched.row_start)[:max_tiles].astype(jnp.int32)
    row_start = sched.row_start[:max_tiles].astype(jnp.int32)
    expert = sched.expert[:max_tiles].astype(jnp.int32)
    real = num_rows > 0
    local = jnp.arange(bm, dtype=jnp.int32)[None, :]
    rows = row_start[:, None] + jnp.minimum(local, jnp.maximum(num_rows - 1, 0)[:, None])
    rows = jnp.clip(rows, 0, capacity - 1)
    tokens = jnp.where(real[:, None], plan.token_ids[rows], 0).astype(jnp.int32)  # [M, bm]
    row_ids = jnp.where(local < num_rows[:, None], tokens, -1 - tokens)
    # Token blocks of each tile: min and max token (robust to any row order in a group).
    lo = jnp.min(tokens, axis=1) // bt
    hi = jnp.max(tokens, axis=1) // bt
    block_lo = jnp.where(real, lo, 0).astype(jnp.int32)
    block_count = jnp.where(real, hi - lo + 1, 0).astype(jnp.int32)
    # Tiles covering each block, as one compare-and-sum ([M, B] is small at decode sizes)
    # rather than a scatter-add of range ends and a cumsum: two fewer kernels per call.
    block = jnp.arange(num_blocks, dtype=jnp.int32)[None, :]
    covers = (block_lo[:, None] <= block) & (block < (block_lo + block_count)[:, None])
    block_target = jnp.sum(covers, axis=0, dtype=jnp.int32) * down_blocks  # empty: count 0
    # Y-slab row of each grouped row: tile index * bm + position in the tile.
    group_sizes = plan.group_sizes.astype(jnp.int32)
    tiles_per_expert = (group_sizes + bm - 1) // bm
    first_tile = jnp.cumsum(tiles_per_expert) - tiles_per_expert  # [E]
    group_start = jnp.cumsum(group_sizes) - group_sizes
    row_expert = jnp.minimum(plan.expert_ids, num_experts - 1)  # [P]; padding rows unused
    in_group = jnp.arange(capacity, dtype=jnp.int32) - group_start[row_expert]
    slab_row = (first_tile[row_expert] + in_group // bm) * bm + in_group % bm
    slab_row = jnp.clip(slab_row, 0, max_tiles * bm - 1).astype(jnp.int32)
    by_token = plan.rows_by_token.astype(jnp.int32)
    scores = multiplied_scores(plan.scores, aggregation).astype(jnp.float32)
    return DecodeMeta(
        counts=jnp.sum(real, dtype=jnp.int32).reshape(1),
        expert=expert,
        row_start=row_start,
        num_rows=num_rows,
        row_ids=row_ids,
        block_lo=block_lo,
        block_count=block_count,
        block_target=block_target,
        offsets=plan.token_row_offsets.astype(jnp.int32),
        agg_row=slab_row[by_token],
        agg_score=scores[by_token],
    )


# ------------------------------------------------------------------ the kernel


class Groups(NamedTuple):
    """A plan's expert groups in registers, inside a Pallas (Triton) kernel: E padded to
    `e_pad` (a power of two) with empty experts (0 rows, 0 tiles).

    Attributes (all i32[e_pad], but `ok` bool and the totals scalars):
      experts: lane index e; ok: e < E; sizes: rows of expert e (`group_sizes`);
      starts, ends: its first and one-past-last grouped row; total_rows: sum of the sizes.
    """

    experts: jax.Array
    ok: jax.Array
    sizes: jax.Array
    starts: jax.Array
    ends: jax.Array
    total_rows: jax.Array


def load_groups(group_sizes_ref, *, num_experts: int, e_pad: int) -> Groups:
    """`Groups` from an i32[E] ref of group sizes (one masked load and two prefix sums)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    experts = jnp.arange(e_pad, dtype=jnp.int32)
    ok = experts < num_experts
    sizes = plt.load(group_sizes_ref.at[pl.ds(0, e_pad)], mask=ok, other=0)
    ends = jnp.cumsum(sizes)
    return Groups(experts=experts, ok=ok, sizes=sizes, starts=ends - sizes, ends=ends,
                  total_rows=jnp.sum(sizes))


def pick(onehot, values):
    """values[e] for each row of a one-hot [N, Ep] mask: a gather from registers."""
    return jnp.sum(jnp.where(onehot, values[None, :], 0), axis=1)


class RowTiles(NamedTuple):
    """A chunk of `tile_schedule`'s row tiles with their token ids (`_common.tile_meta`).

    Attributes ([TC] per tile; `tokens` [TC, row_pad]):
      expert: the tile's expert (tiles past the real ones: the last real tile's expert).
      start: its first grouped row (past the real ones: the plan's row count).
      rows: its rows (0 past the real ones).
      tokens: the source token of each of its rows; columns past `rows` (and the padding
        columns up to `row_pad`) repeat the last real row's token, empty tiles read token 0:
        `_common.tile_meta`'s `row_ids`.
    """

    expert: jax.Array
    start: jax.Array
    rows: jax.Array
    tokens: jax.Array


class TilePrefix(NamedTuple):
    """`tile_schedule`'s per-expert tile counts for one block size, in registers: each
    expert's inclusive end tile (`tile_ends`) and first tile (`first_tile`), i32[e_pad], and
    the number of real tiles (`total_tiles`)."""

    tile_ends: jax.Array
    first_tile: jax.Array
    total_tiles: jax.Array


def row_tile_prefix(groups: Groups, block_m: int) -> TilePrefix:
    """`TilePrefix` of `block_m`-row tiles (computed once per kernel, outside its loops)."""
    tiles_of = (groups.sizes + block_m - 1) // block_m  # padding experts: 0 tiles
    tile_ends = jnp.cumsum(tiles_of)
    return TilePrefix(tile_ends=tile_ends, first_tile=tile_ends - tiles_of,
                      total_tiles=jnp.sum(tiles_of))


def row_tiles(groups: Groups, prefix: TilePrefix, token_ids_ref, tile, tile_ok, *, capacity: int,
              block_m: int, row_pad: int) -> RowTiles:
    """Row tiles `tile` (i32[TC]) of `tile_schedule(group_sizes, capacity, block_m)` with
    their tokens, the formulas of `tile_schedule` and `_common.tile_meta` in the same cases
    (so bit for bit theirs). `prefix`: `row_tile_prefix(groups, block_m)`. Lanes where
    `tile_ok` is False load nothing (their tokens are 0). `row_pad` >= `block_m`, a power of
    two: the tokens' columns (Triton blocks are powers of two).

    Shared by the decode metadata kernel (`_meta_kernel`) and the kernel-by-kernel
    forward's (`schedules._forward_schedules_kernel`)."""
    from jax.experimental.pallas import triton as plt

    i32 = jnp.int32
    tile_ends, first_tile, total_tiles = prefix
    # Tiles past the real ones take the last real tile's expert (`tile_schedule`).
    probe = jnp.minimum(tile, total_tiles - 1)
    expert = jnp.sum(
        (groups.ok[None, :] & (tile_ends[None, :] <= probe[:, None])).astype(i32), axis=1
    )  # [TC]
    onehot = groups.experts[None, :] == expert[:, None]  # [TC, Ep]
    is_real = tile < total_tiles
    start = pick(onehot, groups.starts) + (tile - pick(onehot, first_tile)) * block_m
    end = jnp.minimum(start + block_m, pick(onehot, groups.ends))
    start = jnp.where(is_real, start, groups.total_rows)
    rows_in = jnp.where(is_real, end, groups.total_rows) - start  # [TC]
    local = jnp.arange(row_pad, dtype=i32)[None, :]  # [1, row_pad]
    rows = start[:, None] + jnp.minimum(local, jnp.maximum(rows_in - 1, 0)[:, None])
    rows = jnp.clip(rows, 0, capacity - 1)  # [TC, row_pad]
    load_ok = jnp.broadcast_to(((rows_in > 0) & tile_ok)[:, None], rows.shape)
    tokens = plt.load(token_ids_ref.at[jnp.where(load_ok, rows, 0)], mask=load_ok, other=0)
    return RowTiles(expert=expert, start=start, rows=rows_in, tokens=tokens)


def _meta_kernel(
    group_sizes_ref, token_ids_ref, rows_by_token_ref, scores_ref,
    counts_ref, expert_ref, row_start_ref, num_rows_ref, row_ids_ref, block_lo_ref,
    block_count_ref, block_target_ref, agg_row_ref, agg_score_ref, *,
    num_experts: int, capacity: int, max_tiles: int, num_blocks: int, block_m: int,
    token_block: int, down_blocks: int, e_pad: int, b_pad: int, tile_chunk: int,
    row_chunk: int,
):
    """The whole `DecodeMeta` of one plan in one program, as `decode_meta_reference`
    computes it (the same integer formulas, in the same cases)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i32 = jnp.int32
    groups = load_groups(group_sizes_ref, num_experts=num_experts, e_pad=e_pad)
    experts, expert_ok = groups.experts, groups.ok
    group_starts, group_ends = groups.starts, groups.ends
    prefix = row_tile_prefix(groups, block_m)
    first_tile, total_tiles = prefix.first_tile, prefix.total_tiles

    local = jnp.arange(block_m, dtype=i32)[None, :]  # [1, bm]
    blocks = jnp.arange(b_pad, dtype=i32)[None, :]  # [1, Bp]

    def tile_step(c, target):
        tile = c * tile_chunk + jnp.arange(tile_chunk, dtype=i32)  # [TC]
        tile_ok = tile < max_tiles
        tiles = row_tiles(groups, prefix, token_ids_ref, tile, tile_ok, capacity=capacity,
                          block_m=block_m, row_pad=block_m)
        expert, start, rows_in, tokens = tiles
        real = rows_in > 0
        row_ids = jnp.where(local < rows_in[:, None], tokens, -1 - tokens)
        lo = jnp.min(tokens, axis=1) // token_block
        hi = jnp.max(tokens, axis=1) // token_block
        block_lo = jnp.where(real, lo, 0)
        block_count = jnp.where(real, hi - lo + 1, 0)
        covers = (
            tile_ok[:, None] & (block_lo[:, None] <= blocks)
            & (blocks < (block_lo + block_count)[:, None])
        )  # [TC, Bp]
        # Masked lanes point one past the end: never written on the GPU, dropped in
        # interpret mode (as in `routing.kernels`).
        at = jnp.where(tile_ok, tile, max_tiles)
        plt.store(expert_ref.at[at], expert, mask=tile_ok)
        plt.store(row_start_ref.at[at], start, mask=tile_ok)
        plt.store(num_rows_ref.at[at], rows_in, mask=tile_ok)
        plt.store(block_lo_ref.at[at], block_lo, mask=tile_ok)
        plt.store(block_count_ref.at[at], block_count, mask=tile_ok)
        store_ok = jnp.broadcast_to(tile_ok[:, None], tokens.shape)
        flat = jnp.where(store_ok, tile[:, None] * block_m + local, max_tiles * block_m)
        plt.store(row_ids_ref.at[flat], row_ids, mask=store_ok)
        return target + jnp.sum(covers.astype(i32), axis=0)

    covered = jax.lax.fori_loop(
        0, -(-max_tiles // tile_chunk), tile_step, jnp.zeros((b_pad,), i32)
    )
    block_ok = jnp.arange(b_pad, dtype=i32) < num_blocks
    plt.store(block_target_ref.at[pl.ds(0, b_pad)], covered * down_blocks, mask=block_ok)
    counts_ref[0] = total_tiles  # every real tile has >= 1 row

    def row_step(c, carry):
        pos = c * row_chunk + jnp.arange(row_chunk, dtype=i32)  # [RC] CSR positions
        pos_ok = pos < capacity
        at = jnp.where(pos_ok, pos, capacity)
        row = plt.load(rows_by_token_ref.at[jnp.where(pos_ok, pos, 0)], mask=pos_ok, other=0)
        row = jnp.clip(row, 0, capacity - 1)  # in [0, P) in a valid plan; keeps loads in bounds
        # The row's expert (`DispatchPlan.expert_ids`), padding rows the last expert's.
        expert = jnp.sum(
            (expert_ok[None, :] & (group_ends[None, :] <= row[:, None])).astype(i32), axis=1
        )
        onehot = experts[None, :] == jnp.minimum(expert, num_experts - 1)[:, None]
        in_group = row - pick(onehot, group_starts)  # >= 0
        slab = (pick(onehot, first_tile) + in_group // block_m) * block_m + in_group % block_m
        plt.store(agg_row_ref.at[at], jnp.clip(slab, 0, max_tiles * block_m - 1), mask=pos_ok)
        score = plt.load(scores_ref.at[row], mask=pos_ok, other=0.0)
        plt.store(agg_score_ref.at[at], score, mask=pos_ok)
        return carry

    jax.lax.fori_loop(0, -(-capacity // row_chunk), row_step, jnp.int32(0))


def _decode_meta_kernel(plan, config, d: int, aggregation: str, *, interpret: bool) -> DecodeMeta:
    from jax.experimental.pallas import triton as plt

    from pallas_moe._vma import pallas_call
    from pallas_moe.routing.kernels import next_pow2

    bm = config.block_m
    capacity, num_experts, num_tokens = plan.capacity, plan.num_experts, plan.num_tokens
    max_tiles = max_decode_tiles(capacity, num_experts, bm)
    num_blocks = -(-num_tokens // config.token_block)
    kernel = functools.partial(
        _meta_kernel, num_experts=num_experts, capacity=capacity, max_tiles=max_tiles,
        num_blocks=num_blocks, block_m=bm, token_block=config.token_block,
        down_blocks=d // config.down_block_n, e_pad=next_pow2(num_experts),
        b_pad=next_pow2(num_blocks), tile_chunk=min(TILE_CHUNK, next_pow2(max_tiles)),
        row_chunk=min(ROW_CHUNK, next_pow2(capacity)),
    )
    i32 = jnp.int32
    tiles = jax.ShapeDtypeStruct((max_tiles,), i32)
    out_shape = (
        jax.ShapeDtypeStruct((1,), i32),  # counts
        tiles, tiles, tiles,  # expert, row_start, num_rows
        jax.ShapeDtypeStruct((max_tiles * bm,), i32),  # row_ids
        tiles, tiles,  # block_lo, block_count
        jax.ShapeDtypeStruct((num_blocks,), i32),  # block_target
        jax.ShapeDtypeStruct((capacity,), i32),  # agg_row
        jax.ShapeDtypeStruct((capacity,), jnp.float32),  # agg_score
    )
    (counts, expert, row_start, num_rows, row_ids, block_lo, block_count, block_target,
     agg_row, agg_score) = pallas_call(
        kernel, out_shape=out_shape, grid=(1,), interpret=interpret, name="moe_tile_meta",
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(
        plan.group_sizes.astype(i32), plan.token_ids.astype(i32),
        plan.rows_by_token.astype(i32), plan.scores.astype(jnp.float32),
    )
    return DecodeMeta(
        counts=counts, expert=expert, row_start=row_start, num_rows=num_rows,
        row_ids=row_ids.reshape(max_tiles, bm), block_lo=block_lo, block_count=block_count,
        block_target=block_target, offsets=plan.token_row_offsets.astype(i32),
        agg_row=agg_row,
        # The aggregation's rounding of the weights stays in jnp: a no-op for "fp32", XLA's
        # own f32 -> bf16 -> f32 for the bf16 modes (bitwise the reference's).
        agg_score=multiplied_scores(agg_score, aggregation).astype(jnp.float32),
    )
