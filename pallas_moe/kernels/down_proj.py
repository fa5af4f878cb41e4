"""Down-projection: the forward's second grouped GEMM, a spec on `grouped_gemm`.

    Y[r] = A[r] @ W2[e(r)] + b2[e(r)]    A bf16 [P_a, n], W2 bf16 [E, n, d] -> Y bf16 [P, d]

(the expert bias b2 [E, d] is optional; it is added in fp32 before Y is rounded).
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels._common import TileChunks, TileMeta
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul


def down_proj(
    a: jax.Array,
    group_sizes: jax.Array,
    w_down: jax.Array,
    *,
    config: GroupedMatmulConfig = GroupedMatmulConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: TileMeta | None = None,
    capacity: int | None = None,
    out_cols: int | None = None,
    bias: jax.Array | None = None,
    chunks: TileChunks | None = None,
    chunk: int = 0,
) -> jax.Array:
    """Grouped down-projection.

    Args:
      a: bf16 [P_a, n] activations in grouped row order (the up-proj's A). `P_a` may exceed
        the plan's capacity P (the up-proj pads A to a multiple of block_m, which saves a
        copy here); extra rows are ignored.
      group_sizes: i32 [E] rows per expert; rows past the sum are padding.
      w_down: bf16 [E, n, d].
      config: block sizes of the persistent grouped GEMM.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.
      meta: precomputed `aligned_tile_meta(group_sizes, capacity, config.tile_rows)`.
      capacity: the plan's row capacity P (default a.shape[0]).
      out_cols: width of the returned array (default d); columns past d are not written.
      bias: optional bf16 [E, d] expert bias.
      chunks, chunk: run only chunk `chunk` of these `TileChunks` of `meta` (the chunked
        EP overlap, `pallas_moe.ops.row_chunks`): see `grouped_matmul`.

    Returns:
      y: bf16 [P, out_cols], or `[chunks.rows, out_cols]` with `chunks` (row j holds grouped
      row `chunks.bounds[1, chunk] + j`). Padding rows are not written (their contents are
      unspecified).
    """
    return grouped_matmul(
        a, group_sizes, w_down, transpose_w=False, config=config, interpret=interpret,
        meta=meta, capacity=capacity, out_cols=out_cols, names=("a", "w_down"),
        kernel_name="moe_down_proj", bias=bias, chunks=chunks, chunk=chunk,
    )
