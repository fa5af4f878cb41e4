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
    tiles = _TileMetas(plan)
    up, down = (forward_schedules(plan, forward, tiles) if forward.decode is None
                else (None, None))
    dh, weight_grad, dx = backward_schedules(plan, backward, tiles)
    return PlanSchedules(up=up, down=down, dh=dh, weight_grad=weight_grad, dx=dx)


def forward_schedules(plan, forward: "ForwardConfig", tiles: "_TileMetas | None" = None
                      ) -> tuple[_common.TileMeta, _common.TileMeta]:
    """The kernel-by-kernel forward's metadata for `plan`: (the up-proj's row tiles with
    token ids, the down-proj's aligned tiles). `tiles`: the cache of a caller that also
    computes the backward's (`plan_schedules`); None starts one."""
    tiles = _TileMetas(plan) if tiles is None else tiles
    return tiles.rows(forward.up.tile_rows), tiles.aligned(forward.down.tile_rows)


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


def require_block(name: str, meta, block: int, field: str = "block_m") -> None:
    """Raises if precomputed metadata `meta` was made for another block size than `block`."""
    got = getattr(meta, field)
    if got != block:
        raise ValueError(
            f"schedules.{name} was computed for {field}={got}, but the config uses {block}: "
            "compute the schedules from the same configs (`plan_schedules`)."
        )
