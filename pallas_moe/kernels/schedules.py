"""Every kernel's tile metadata for one plan, computed once for the forward and backward.

Each Mosaic kernel walks tiles of the plan's grouped rows: the up-proj and dH kernels row
tiles with their token ids (`_common.tile_meta`), the down-proj and dX~ GEMMs row tiles cut
at aligned boundaries (`_common.aligned_tile_meta`), the weight-gradient kernels K-blocks
(`weight_grad.k_block_meta`). `plan_schedules` computes each distinct (kind, block size)
once per plan; the `mosaic` backend's op (`ops/mosaic.py`) computes it in the forward and
saves it for the backward as a small integer residual, so no kernel derives metadata again
(and a dH block equal to the up-proj's reuses its tiles).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax

from pallas_moe.kernels import _common
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


def plan_schedules(plan, forward: "ForwardConfig", backward: "BackwardConfig") -> PlanSchedules:
    """Each kernel's metadata for `plan` (a `DispatchPlan`), each distinct one computed once.

    Args:
      plan: the dispatch plan (its `group_sizes` and `token_ids` are read).
      forward, backward: the resolved kernel configs (`forward_config` / `backward_config`).
    """
    computed: dict[tuple[str, int], _common.TileMeta] = {}

    def row_tiles(block_m: int) -> _common.TileMeta:
        if ("rows", block_m) not in computed:
            computed["rows", block_m] = _common.tile_meta(plan.group_sizes, plan.token_ids, block_m)
        return computed["rows", block_m]

    def aligned_tiles(block_m: int) -> _common.TileMeta:
        if ("aligned", block_m) not in computed:
            computed["aligned", block_m] = _common.aligned_tile_meta(
                plan.group_sizes, plan.capacity, block_m
            )
        return computed["aligned", block_m]

    by_kernels = forward.decode is None
    return PlanSchedules(
        up=row_tiles(forward.up.tile_rows) if by_kernels else None,
        down=aligned_tiles(forward.down.tile_rows) if by_kernels else None,
        dh=(aligned_tiles(backward.dh_gemm.tile_rows) if backward.dh_gemm is not None
            else row_tiles(backward.dh.tile_rows)),
        weight_grad=k_block_meta(plan.group_sizes, plan.token_ids, backward.dw_down.block_k),
        dx=aligned_tiles(backward.dx.tile_rows),
    )


def require_block(name: str, meta, block: int, field: str = "block_m") -> None:
    """Raises if precomputed metadata `meta` was made for another block size than `block`."""
    got = getattr(meta, field)
    if got != block:
        raise ValueError(
            f"schedules.{name} was computed for {field}={got}, but the config uses {block}: "
            "compute the schedules from the same configs (`plan_schedules`)."
        )
