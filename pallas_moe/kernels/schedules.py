"""Every kernel's tile metadata for one plan, computed once for the forward and backward.

Each Mosaic kernel walks tiles of the plan's grouped rows: the up-proj and dH kernels row
tiles with their token ids (`_common.tile_meta`), the down-proj and dX~ GEMMs row tiles cut
at aligned boundaries (`_common.aligned_tile_meta`), the weight-gradient kernels K-blocks
(`weight_grad.k_block_meta`). `plan_schedules` computes each distinct (kind, block size)
once per plan; the `mosaic` backend's op (`ops/mosaic.py`) computes it in the forward and
saves it for the backward as a small integer residual, so no kernel derives metadata again
(and a dH block equal to the up-proj's reuses its tiles).

The forward's two (the up-proj's row tiles, the down-proj's aligned tiles) can also come
from one small Pallas launch, `moe_forward_schedules` (`forward_schedule_kernel`,
`ForwardConfig.schedule_impl="kernel"`): bit for bit the same arrays, in one launch instead
of 8 launch-bound XLA fusions (~12 us of a T = 8 call on the H100, issue 15). Its row
tiles are the decode metadata kernel's (`decode_meta.row_tiles`). The default stays the jnp
formulas until a GPU run measures it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from pallas_moe.kernels import _common
from pallas_moe.kernels.decode_meta import (
    TILE_CHUNK, load_groups, pick, resolve_meta_impl, row_tile_prefix, row_tiles,
)
from pallas_moe.kernels.weight_grad import KBlockMeta, k_block_meta

if TYPE_CHECKING:  # the configs import the kernels, which import this module
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["up", "down", "dh", "weight_grad", "dx"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class PlanSchedules:
    """The tile metadata of every kernel of one plan (integer arrays; no gradient).

    Attributes:
      up: row tiles of `ForwardConfig.up.tile_rows` rows, with token ids (up-proj). None
        when the forward is the decode megakernel, which schedules its own tasks.
      down: aligned row tiles of `ForwardConfig.down.tile_rows` rows (down-proj). None as `up`.
      dh: row tiles of `BackwardConfig.dh.tile_rows` rows, with token ids (dH kernel), or
        aligned row tiles of `BackwardConfig.dh_gemm.tile_rows` rows (the split dH's GEMM).
      weight_grad: K-blocks of `BackwardConfig.dw_down.block_k` rows (both weight gradients).
      dx: aligned row tiles of `BackwardConfig.dx.tile_rows` rows (dX~ GEMM).
    """

    up: _common.TileMeta | None
    down: _common.TileMeta | None
    dh: _common.TileMeta
    weight_grad: KBlockMeta
    dx: _common.TileMeta


def plan_schedules(plan, forward: "ForwardConfig", backward: "BackwardConfig", *,
                   interpret=False) -> PlanSchedules:
    """Each kernel's metadata for `plan` (a `DispatchPlan`), each distinct one computed once.

    Args:
      plan: the dispatch plan (its `group_sizes` and `token_ids` are read).
      forward, backward: the resolved kernel configs (`forward_config` / `backward_config`);
        `forward.schedule_impl` picks how the forward's are computed (`forward_schedules`).
      interpret: the kernels run in interpret mode (True or an `InterpretGPUParams`): a
        schedule kernel runs interpreted too.
    """
    tiles = _TileMetas(plan)
    up, down = (forward_schedules(plan, forward, tiles, interpret=interpret)
                if forward.decode is None else (None, None))
    dh, weight_grad, dx = backward_schedules(plan, backward, tiles)
    return PlanSchedules(up=up, down=down, dh=dh, weight_grad=weight_grad, dx=dx)


def forward_schedules(plan, forward: "ForwardConfig", tiles: "_TileMetas | None" = None, *,
                      interpret=False) -> tuple[_common.TileMeta, _common.TileMeta]:
    """The kernel-by-kernel forward's metadata for `plan`: (the up-proj's row tiles with
    token ids, the down-proj's aligned tiles). `tiles`: the cache of a caller that also
    computes the backward's (`plan_schedules`); None starts one.

    `forward.schedule_impl` picks how (`resolve_schedule_impl`): the jnp formulas
    (`_common.tile_meta`, `_common.aligned_tile_meta`) or both from one Pallas launch
    (`forward_schedule_kernel`), bit for bit the same arrays. `interpret`: the kernels run
    in interpret mode (True or an `InterpretGPUParams`); then "kernel" runs the Pallas
    launch interpreted too. The backward's schedules stay jnp; where its block sizes equal
    the forward's it reuses these (`tiles`)."""
    tiles = _TileMetas(plan) if tiles is None else tiles
    up_rows, down_rows = forward.up.tile_rows, forward.down.tile_rows
    impl = resolve_schedule_impl(forward.schedule_impl, plan.num_tokens, interpret)
    if impl != "jnp":
        up, down = forward_schedule_kernel(
            plan.group_sizes, plan.token_ids, up_rows, down_rows,
            interpret=impl == "interpret",
        )
        tiles.put("rows", up)
        tiles.put("aligned", down)
    return tiles.rows(up_rows), tiles.aligned(down_rows)


def backward_schedules(plan, backward: "BackwardConfig", tiles: "_TileMetas | None" = None
                       ) -> tuple[_common.TileMeta, KBlockMeta, _common.TileMeta]:
    """The backward kernels' metadata for `plan`: (dH's tiles, the weight gradients'
    K-blocks, dX~'s aligned tiles). dH takes row tiles with token ids for the fused kernel,
    or aligned tiles for the split dH's GEMM (`backward.dh_gemm`). `tiles`: the cache of a
    caller that also computes the forward's (`plan_schedules`); None starts one."""
    tiles = _TileMetas(plan) if tiles is None else tiles
    dh = (tiles.aligned(backward.dh_gemm.tile_rows) if backward.dh_gemm is not None
          else tiles.rows(backward.dh.tile_rows))
    weight_grad = k_block_meta(plan.group_sizes, plan.token_ids, backward.dw_down.block_k)
    return dh, weight_grad, tiles.aligned(backward.dx.tile_rows)


class _TileMetas:
    """One plan's row tiles (`_common.tile_meta`) and aligned tiles
    (`_common.aligned_tile_meta`), each block size computed once."""

    def __init__(self, plan):
        self._plan = plan
        self._computed: dict[tuple[str, int], _common.TileMeta] = {}

    def has(self, kind: str, block_m: int) -> bool:
        return (kind, block_m) in self._computed

    def put(self, kind: str, meta: _common.TileMeta) -> None:
        """Records `meta` (computed elsewhere, e.g. by `forward_schedule_kernel`) as the
        `kind` ("rows" or "aligned") tiles of its block size, unless those are known."""
        self._computed.setdefault((kind, meta.block_m), meta)

    def rows(self, block_m: int) -> _common.TileMeta:
        if ("rows", block_m) not in self._computed:
            self._computed["rows", block_m] = _common.tile_meta(
                self._plan.group_sizes, self._plan.token_ids, block_m)
        return self._computed["rows", block_m]

    def aligned(self, block_m: int) -> _common.TileMeta:
        if ("aligned", block_m) not in self._computed:
            self._computed["aligned", block_m] = _common.aligned_tile_meta(
                self._plan.group_sizes, self._plan.capacity, block_m)
        return self._computed["aligned", block_m]


# ------------------------------------------------------- the forward's schedules in one kernel

# `ForwardConfig.schedule_impl` values; "interpret" (the kernel in Pallas interpret mode) is
# what "kernel" becomes where the Mosaic kernels run interpreted.
SCHEDULE_IMPLS = ("jnp", "kernel", "auto")
# `schedule_impl="auto"` runs the schedule kernel for batches of at most this many tokens:
# the sizes it was written for (plans of up to 1024 rows at K = 8). NOT measured yet; "auto"
# is not the default until a GPU run (`benchmarks/decode.py --variants kernels,kernels_meta`)
# sets this threshold.
SCHEDULE_KERNEL_MAX_TOKENS = 128
# The most [tiles, row_pad] token ids one program of the schedule kernel gathers (programs
# take the decode metadata kernel's `TILE_CHUNK` tiles; the up-proj's tiles are 64-384 rows:
# fewer tiles per program for the tallest).
CHUNK_ELEMENTS = 4096


def resolve_schedule_impl(schedule_impl: str, num_tokens: int, interpret=False) -> str:
    """`ForwardConfig.schedule_impl` for a batch of `num_tokens` tokens: "jnp", "kernel" or
    "interpret". "auto" is "kernel" up to `SCHEDULE_KERNEL_MAX_TOKENS` tokens and "jnp"
    above; "kernel" is "interpret" where the kernels run interpreted (`interpret` True or an
    `InterpretGPUParams`, as `decode.moe_decode` does with its metadata kernel)."""
    if schedule_impl not in SCHEDULE_IMPLS:
        raise ValueError(
            f"schedule_impl must be one of {SCHEDULE_IMPLS}, got {schedule_impl!r}.")
    return resolve_meta_impl(schedule_impl, num_tokens, max_tokens=SCHEDULE_KERNEL_MAX_TOKENS,
                             interpret=interpret)


def forward_schedule_kernel(group_sizes: jax.Array, token_ids: jax.Array, up_rows: int,
                            down_rows: int, *, interpret: bool = False
                            ) -> tuple[_common.TileMeta, _common.TileMeta]:
    """`(tile_meta(group_sizes, token_ids, up_rows), aligned_tile_meta(group_sizes, P,
    down_rows))` from one small Pallas (Triton backend) launch, `moe_forward_schedules`,
    bit for bit the jnp formulas' arrays (all integer arithmetic, the same formulas in the
    same cases). P = `token_ids.shape[0]`, the plan's capacity. `interpret`: run it in
    Pallas interpret mode (CPU).

    Why: at decode sizes the jnp formulas are 8 small XLA fusions of 1.1-2.2 us each (at
    T = 8 on the H100, Qwen3-30B-A3B widths: ~12 us of the call's 230 us GPU time, issue
    15), every one launch-bound. Each program of the launch takes one chunk of tiles: the
    up-proj's row tiles (`decode_meta.row_tiles`, the decode metadata kernel's own tile
    step: expert, first row, rows and token ids; up to `TILE_CHUNK` tiles and
    `CHUNK_ELEMENTS` token ids a program) or the down-proj's aligned tiles (`TILE_CHUNK` a
    program), after loading the group sizes and taking their prefix sums itself; padding
    lanes point one past the end. Each program's work grows with E (`[tiles, E]` compares),
    the program count with the plan (tiles ~ P / block + E), so it is meant for small
    batches (`SCHEDULE_KERNEL_MAX_TOKENS`). Session 66 measured its first form, one program
    walking the chunks in turn, at 26.6 us (0.94-0.97x the jnp path's whole call at T = 1
    to 128); this form is not yet measured: `ForwardConfig.schedule_impl` defaults to "jnp".
    """
    from jax.experimental.pallas import triton as plt

    from pallas_moe._vma import pallas_call
    from pallas_moe.routing.kernels import next_pow2
    from pallas_moe.routing.plan import max_tiles

    num_experts, capacity = group_sizes.shape[0], token_ids.shape[0]
    up_tiles = max_tiles(capacity, num_experts, up_rows)  # `tile_schedule`'s length
    down_tiles = _common.aligned_max_tiles(capacity, num_experts, down_rows)
    row_pad = next_pow2(up_rows)
    up_chunk = min(TILE_CHUNK, max(1, CHUNK_ELEMENTS // row_pad), next_pow2(up_tiles))
    down_chunk = min(TILE_CHUNK, next_pow2(down_tiles))
    up_programs = -(-up_tiles // up_chunk)
    kernel = functools.partial(
        _forward_schedules_kernel, num_experts=num_experts, capacity=capacity,
        up_rows=up_rows, up_tiles=up_tiles, row_pad=row_pad, up_chunk=up_chunk,
        up_programs=up_programs, down_rows=down_rows, down_tiles=down_tiles,
        down_chunk=down_chunk, e_pad=next_pow2(num_experts),
    )
    i32 = jnp.int32
    up, down = jax.ShapeDtypeStruct((up_tiles,), i32), jax.ShapeDtypeStruct((down_tiles,), i32)
    out_shape = (up, up, up, jax.ShapeDtypeStruct((up_tiles * up_rows,), i32), down, down, down)
    (up_expert, up_start, up_num_rows, row_ids, down_expert, down_start,
     down_num_rows) = pallas_call(
        kernel, out_shape=out_shape, grid=(up_programs + -(-down_tiles // down_chunk),),
        interpret=interpret, name="moe_forward_schedules",
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(group_sizes.astype(i32), token_ids.astype(i32))
    return (
        _common.TileMeta(expert=up_expert, row_start=up_start, num_rows=up_num_rows,
                         row_ids=row_ids.reshape(up_tiles, up_rows), block_m=up_rows),
        _common.TileMeta(expert=down_expert, row_start=down_start, num_rows=down_num_rows,
                         row_ids=jnp.zeros((down_tiles, 1), i32), block_m=down_rows),
    )


def _forward_schedules_kernel(
    group_sizes_ref, token_ids_ref,
    up_expert_ref, up_start_ref, up_rows_ref, up_row_ids_ref,
    down_expert_ref, down_start_ref, down_rows_ref, *,
    num_experts: int, capacity: int, up_rows: int, up_tiles: int, row_pad: int,
    up_chunk: int, up_programs: int, down_rows: int, down_tiles: int, down_chunk: int,
    e_pad: int,
):
    """One chunk of `forward_schedule_kernel`'s tiles per program: programs [0,
    `up_programs`) write `up_chunk` of the up-proj's row tiles each (`decode_meta.row_tiles`,
    as `_common.tile_meta` computes them), the rest `down_chunk` of the down-proj's aligned
    tiles (`_common.aligned_tile_meta`'s closed form). Every program loads the E group sizes
    and takes their prefix sums itself: O(E) work that saves a serial walk over the chunks
    (session 66: the one-program walk took 26.6 us at every T, each chunk ~3 us of
    dependent loads and stores)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i32 = jnp.int32
    program = pl.program_id(0)
    groups = load_groups(group_sizes_ref, num_experts=num_experts, e_pad=e_pad)

    @pl.when(program < up_programs)
    def _up_tiles():
        prefix = row_tile_prefix(groups, up_rows)
        local = jnp.arange(row_pad, dtype=i32)[None, :]  # [1, row_pad]
        tile = program * up_chunk + jnp.arange(up_chunk, dtype=i32)  # [TC]
        tile_ok = tile < up_tiles
        tiles = row_tiles(groups, prefix, token_ids_ref, tile, tile_ok, capacity=capacity,
                          block_m=up_rows, row_pad=row_pad)
        # Masked lanes point one past the end: never written on the GPU, dropped in
        # interpret mode (as in `decode_meta._meta_kernel`).
        at = jnp.where(tile_ok, tile, up_tiles)
        plt.store(up_expert_ref.at[at], tiles.expert, mask=tile_ok)
        plt.store(up_start_ref.at[at], tiles.start, mask=tile_ok)
        plt.store(up_rows_ref.at[at], tiles.rows, mask=tile_ok)
        store_ok = tile_ok[:, None] & (local < up_rows)  # [TC, row_pad]
        flat = jnp.where(store_ok, tile[:, None] * up_rows + local, up_tiles * up_rows)
        plt.store(up_row_ids_ref.at[flat], tiles.tokens, mask=store_ok)

    @pl.when(program >= up_programs)
    def _down_tiles():
        # `aligned_tile_meta`: expert e's rows [lo, hi) are the ceil(hi / bm) - floor(lo /
        # bm) pieces of the aligned blocks they touch, in row order.
        bm = down_rows
        first_block = groups.starts // bm
        pieces = jnp.where(groups.sizes > 0, (groups.ends + bm - 1) // bm - first_block, 0)
        piece_end = jnp.cumsum(pieces)  # padding experts: 0 pieces
        piece_start = piece_end - pieces
        total_pieces = jnp.sum(pieces)
        tile = (program - up_programs) * down_chunk + jnp.arange(down_chunk, dtype=i32)  # [TC]
        tile_ok = tile < down_tiles
        expert = jnp.minimum(jnp.sum(
            (groups.ok[None, :] & (piece_end[None, :] <= tile[:, None])).astype(i32), axis=1
        ), num_experts - 1)  # [TC]; past the real tiles the last expert
        onehot = groups.experts[None, :] == expert[:, None]  # [TC, Ep]
        block = pick(onehot, first_block) + tile - pick(onehot, piece_start)
        start = jnp.maximum(pick(onehot, groups.starts), block * bm)
        end = jnp.minimum(pick(onehot, groups.ends), (block + 1) * bm)
        is_real = tile < total_pieces
        at = jnp.where(tile_ok, tile, down_tiles)
        plt.store(down_expert_ref.at[at], expert, mask=tile_ok)
        plt.store(down_start_ref.at[at], jnp.where(is_real, start, groups.total_rows),
                  mask=tile_ok)
        plt.store(down_rows_ref.at[at], jnp.where(is_real, end - start, 0), mask=tile_ok)


def require_block(name: str, meta, block: int, field: str = "block_m") -> None:
    """Raises if precomputed metadata `meta` was made for another block size than `block`."""
    got = getattr(meta, field)
    if got != block:
        raise ValueError(
            f"schedules.{name} was computed for {field}={got}, but the config uses {block}: "
            "compute the schedules from the same configs (`plan_schedules`)."
        )
