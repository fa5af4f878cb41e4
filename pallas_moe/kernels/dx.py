"""dX~: the backward's input-gradient grouped GEMM, a spec on `grouped_gemm`.

    dX~[r] = dH[r] @ W1[e(r)]^T        dH bf16 [P_pad, 2n], W1 bf16 [E, d, 2n] -> bf16 [P, w]

(then `dX[t] = sum of the token's rows of dX~`, the forward's aggregation without scores).
W1 is read in its public `[E, d, 2n]` layout: `[block_n, block_k]` K-minor tiles fed to wgmma
transposed.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels._common import TileMeta
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul


def dx_rows(
    dh: jax.Array,
    group_sizes: jax.Array,
    w_gate_up: jax.Array,
    *,
    capacity: int,
    config: GroupedMatmulConfig = GroupedMatmulConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: TileMeta | None = None,
    out_cols: int | None = None,
) -> jax.Array:
    """Per-row input gradient `dX~ = dH @ W1[e]^T`.

    Args:
      dh: bf16 [P_pad, 2n] in grouped row order (the dH kernel's output), P_pad >= P.
      group_sizes: i32 [E] rows per expert; rows past the sum are padding.
      w_gate_up: bf16 [E, d, 2n].
      capacity: the plan's row capacity P.
      config: block sizes of the persistent grouped GEMM.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.
      meta: precomputed `aligned_tile_meta(group_sizes, capacity, config.tile_rows)`.
      out_cols: width of the result (default d); columns past d are not written.

    Returns:
      bf16 [P, out_cols]. Padding rows are not written (unspecified).
    """
    return grouped_matmul(
        dh, group_sizes, w_gate_up, transpose_w=True, config=config, interpret=interpret,
        meta=meta, capacity=capacity, out_cols=out_cols, names=("dh", "w_gate_up"),
        kernel_name="moe_dx_rows",
    )
