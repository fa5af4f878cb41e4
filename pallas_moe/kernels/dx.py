"""dX~: varlen-M grouped GEMM of dH with the transposed gate/up weights.

    dX~[r] = dH[r] @ W1[e(r)]^T        dH bf16 [P_pad, 2n], W1 bf16 [E, d, 2n] -> bf16 [P, w]

(then `dX[t] = sum of the token's rows of dX~`, the forward's aggregation without scores).

Same structure as the down-proj: dH is contiguous, so each stage is one `[block_m, block_k]`
TMA box; tiles come from `aligned_tile_meta` (a tile is a piece of one expert's rows inside
one `block_m`-aligned block, whose CTA loads the whole aligned block) and only the tile's rows
are stored (`store_rows`). B is `W1[e][c0:c0+bn, k:k+bk]` (`[bn, bk]`, K-minor) fed to wgmma
transposed, so the public `[E, d, 2n]` layout is read as is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels._common import TileMeta


@dataclasses.dataclass(frozen=True)
class DXConfig:
    """Block sizes of the dX~ kernel.

    Attributes:
      block_m: rows per tile (multiple of 64).
      block_n: output columns (of d) per CTA (multiple of 64, divides d, at most 256).
      block_k: contraction step over 2n; must be 64 and divide 2n.
      num_stages: SMEM pipeline depth.
    """

    block_m: int = 64
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4


def dx_rows(
    dh: jax.Array,
    group_sizes: jax.Array,
    w_gate_up: jax.Array,
    *,
    capacity: int,
    config: DXConfig = DXConfig(),
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
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.
      meta: precomputed `aligned_tile_meta(group_sizes, capacity, config.block_m)`.
      out_cols: width of the result (default d); columns past d are not written.

    Returns:
      bf16 [P, out_cols]. Padding rows are not written (unspecified).
    """
    if dh.ndim != 2:
        raise ValueError(f"dh must be [P, 2n], got shape {tuple(dh.shape)}.")
    if w_gate_up.ndim != 3:
        raise ValueError(f"w_gate_up must be [E, d, 2n], got shape {tuple(w_gate_up.shape)}.")
    _common.require_dtype("dh", dh, jnp.bfloat16)
    _common.require_dtype("w_gate_up", w_gate_up, jnp.bfloat16)
    dh_rows, two_n = dh.shape
    num_experts, d, two_n2 = w_gate_up.shape
    if two_n2 != two_n:
        raise ValueError(f"w_gate_up.shape[2]={two_n2} must equal dh.shape[1]={two_n}.")
    if capacity > dh_rows:
        raise ValueError(f"capacity={capacity} exceeds dh.shape[0]={dh_rows}.")
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    _common.require_wgmma_blocks(config, "B tiles are 128-byte swizzled")
    _common.require_multiple("2n (dh.shape[1])", two_n, bk, f"the K loop steps by block_k={bk}")
    _common.require_multiple(
        "d (w_gate_up.shape[1])", d, bn, f"a CTA computes block_n={bn} columns"
    )
    out_cols = d if out_cols is None else out_cols
    if out_cols < d:
        raise ValueError(f"out_cols={out_cols} must be >= d={d}.")
    if meta is None:
        meta = _common.aligned_tile_meta(group_sizes, capacity, bm)
    if meta.block_m != bm:
        raise ValueError(f"meta.block_m={meta.block_m} must equal config.block_m={bm}.")
    padded = -(-capacity // bm) * bm  # each tile loads its whole aligned block
    if dh_rows < padded:
        dh = jnp.pad(dh, ((0, padded - dh_rows), (0, 0)))
    num_k = two_n // bk
    grid_n = d // bn
    dtype = dh.dtype
    tf = _common.mma_transforms(dtype)

    def body(expert_ref, start_ref, rows_ref, dh_ref, w_ref, out_ref, a_smem, b_smem, o_smem, bars):
        ni = jax.lax.axis_index("n")
        mi = jax.lax.axis_index("m")
        num_rows = rows_ref[mi]

        @pl.when(num_rows > 0)
        def _():
            expert = expert_ref[mi]
            row0 = start_ref[mi]
            box0 = (row0 // bm) * bm  # the aligned block holding the tile
            c0 = ni * bn
            w_e = w_ref.at[expert]  # [d, 2n]

            def issue(ki, slot):
                k0 = ki * bk
                plgpu.copy_gmem_to_smem(  # [bm, bk]
                    dh_ref.at[pl.ds(box0, bm), pl.ds(k0, bk)], a_smem.at[slot], bars.at[slot]
                )
                plgpu.copy_gmem_to_smem(  # [bn, bk] rows c0.. of W1[e], K-minor
                    w_e.at[pl.ds(c0, bn), pl.ds(k0, bk)], b_smem.at[slot], bars.at[slot]
                )

            def mma_scope(acc):
                def mma(slot):
                    # [bm, bk] @ [bk, bn]
                    plgpu.wgmma(acc, a_smem.at[slot], b_smem.at[slot].transpose((1, 0)))

                _common.k_pipeline(num_k, stages, bars, issue, mma, mmas_per_step=1)
                return acc[...]

            y = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn), jnp.float32))  # [bm, bn] f32
            o_smem[...] = y.astype(dtype)
            plgpu.commit_smem()
            _common.store_rows(
                o_smem, out_ref.at[:, pl.ds(c0, bn)], row0, num_rows, bm, src_row0=row0 - box0
            )
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        kernel_name="moe_dx_rows",
        out_type=jax.ShapeDtypeStruct((capacity, out_cols), dtype),
        scratch_types=[
            plgpu.SMEM((stages, bm, bk), dtype, transforms=tf),
            plgpu.SMEM((stages, bn, bk), dtype, transforms=tf),
            plgpu.SMEM((bm, bn), dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ],
        grid=(grid_n, meta.num_tiles),
        grid_names=("n", "m"),
        interpret=_common.interpret_params(interpret),
    )
    return kernel(meta.expert, meta.row_start, meta.num_rows, dh, w_gate_up)
