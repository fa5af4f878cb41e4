"""The persistent varlen-M grouped GEMM over rows already grouped by expert.

    out[r] = A[r] @ W[e(r)]          A bf16 [P_a, K], W bf16 [E, K, N]   (`transpose_w=False`)
    out[r] = A[r] @ W[e(r)]^T        A bf16 [P_a, K], W bf16 [E, N, K]   (`transpose_w=True`)
    (+ bias[e(r)])                   optional bias bf16 [E, N], added in fp32 before rounding

Two kernels are specs on it: the forward's down-proj (`Y = A @ W2[e] + b2[e]`, `down_proj.py`) and
the backward's dX~ (`dX~ = dH @ W1[e]^T`, `dx.py`, which reads the public `[E, d, 2n]`
layout as is by feeding K-minor weight tiles to wgmma transposed).

A is contiguous, so each stage is one `[block_m, block_k]` TMA box. Mosaic's tiled TMA needs
the box's first row to be a multiple of 8, so tiles come from `aligned_tile_meta` (computed
once per plan): a tile is a piece of one expert's rows inside one `block_m`-aligned block,
and its work item loads the whole aligned block. Rows of the box outside the tile (other
experts, padding) are multiplied like the rest and dropped: the epilogue TMA-stores only the
tile's rows (`store_rows`), so a tile never writes another expert's rows.

The kernel is persistent: `num_sms` CTAs of one producer and two consumer warpgroups. Work
item w = (tile w // grid_n, column block w % grid_n); CTA s takes items s, s + num_sms, ...
over the real tiles (`aligned_tile_meta` puts them first). The producer issues every K step
of every item back to back into a `num_stages`-slot ring (step g uses slot g % num_stages,
waits `empty[slot]`, arrives on `full[.., slot]`), so the next item's loads run during the
current item's epilogue.
- `block_m == 64` (ping-pong): the CTA's j-th item goes to consumer j % 2, so one
  consumer's epilogue overlaps the other's wgmmas; each consumer waits only on its own
  `full` barriers, so its phase tracking stays exact.
- `block_m == 128` (split M): both consumers share every item, consumer c multiplying rows
  [64c, 64c + 64) of the A box by the same weight tile, so each weight tile streamed from L2
  feeds 128 rows (~11 KB of SMEM operands per MFLOP instead of ~19 KB); both release each
  slot, and a consumer's epilogue store drains while the next item's wgmmas run.

With a bias, each consumer TMA-loads its item's `[block_n]` bias columns into its own SMEM
when the item starts (they land while the K loop runs) and adds them to the fp32
accumulator in the epilogue (`_common.bias_columns`). The SMEM is rewritten only after the
previous item's epilogue has read it: the epilogue's `commit_smem` (a warpgroup barrier)
comes between the reads and the next copy.
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
class GroupedMatmulConfig:
    """Block sizes of the persistent grouped GEMM (down-proj, dX~).

    Attributes:
      block_m: rows per work item: 64 (ping-pong consumers) or 128 (split M).
      block_n: output columns per work item (multiple of 64, divides N, at most 256).
      block_k: contraction step; must be 64 and divide K.
      num_stages: SMEM pipeline depth (>= 2).
      num_sms: CTAs of the persistent grid (the SM count: 132 on an H100 SXM).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    num_sms: int = 132

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"config.block_m={self.block_m} must be 64 or 128.")
        _common.require_wgmma_blocks(self, "output tiles are 128-byte swizzled")
        if self.num_sms < 1:
            raise ValueError(f"config.num_sms={self.num_sms} must be >= 1.")


def grouped_matmul(
    a: jax.Array,
    group_sizes: jax.Array,
    w: jax.Array,
    *,
    transpose_w: bool,
    config: GroupedMatmulConfig = GroupedMatmulConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: TileMeta | None = None,
    capacity: int | None = None,
    out_cols: int | None = None,
    names: tuple[str, str] = ("a", "w"),
    kernel_name: str = "moe_grouped_matmul",
    bias: jax.Array | None = None,
) -> jax.Array:
    """`out[r] = A[r] @ W[e(r)]` (or `@ W[e(r)]^T`) over rows grouped by expert.

    Args:
      a: bf16 [P_a, K] rows in grouped order. `P_a` may exceed `capacity` (a producer may
        pad to a multiple of block_m, which saves a copy here); extra rows are ignored.
      group_sizes: i32 [E] rows per expert; rows past the sum are padding.
      w: bf16 [E, K, N], or [E, N, K] with `transpose_w`.
      transpose_w: read W K-minor (`[E, N, K]`) and multiply by its transpose.
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.
      meta: precomputed `aligned_tile_meta(group_sizes, capacity, config.block_m)`.
      capacity: the plan's row capacity P (default a.shape[0]).
      out_cols: width of the result (default N); columns past N are not written.
      names: how errors name `a` and `w` (the caller's argument names).
      kernel_name: the kernel's name in profiles.
      bias: optional bf16 [E, N]: `out[r] += bias[e(r)]` in fp32 before rounding.

    Returns:
      bf16 [P, out_cols]. Padding rows are not written (their contents are unspecified).
    """
    a_name, w_name = names
    if a.ndim != 2:
        raise ValueError(f"{a_name} must be 2-D [P, K], got shape {tuple(a.shape)}.")
    if w.ndim != 3:
        raise ValueError(f"{w_name} must be 3-D, got shape {tuple(w.shape)}.")
    _common.require_dtype(a_name, a, jnp.bfloat16)
    _common.require_dtype(w_name, w, jnp.bfloat16)
    a_rows, k_dim = a.shape
    num_experts = w.shape[0]
    w_k, n_dim = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    k_axis, n_axis = (2, 1) if transpose_w else (1, 2)
    if w_k != k_dim:
        raise ValueError(
            f"{w_name}.shape[{k_axis}]={w_k} must equal {a_name}.shape[1]={k_dim} (the contraction)."
        )
    capacity = a_rows if capacity is None else capacity
    if capacity > a_rows:
        raise ValueError(f"capacity={capacity} exceeds {a_name}.shape[0]={a_rows}.")
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    _common.require_multiple(
        f"{a_name}.shape[1]", k_dim, bk, f"the K loop steps by block_k={bk}"
    )
    _common.require_multiple(
        f"{w_name}.shape[{n_axis}]", n_dim, bn, f"a work item computes block_n={bn} columns"
    )
    if bias is not None:
        _common.require_dtype("bias", bias, jnp.bfloat16)
        _common.require_shape("bias", bias, (num_experts, n_dim))
    out_cols = n_dim if out_cols is None else out_cols
    if out_cols < n_dim:
        raise ValueError(f"out_cols={out_cols} must be >= {n_dim}.")
    if meta is None:
        meta = _common.aligned_tile_meta(group_sizes, capacity, bm)
    if meta.block_m != bm:
        raise ValueError(f"meta.block_m={meta.block_m} must equal config.block_m={bm}.")
    # Each item loads its whole aligned block: make `a` a whole number of blocks.
    padded = -(-capacity // bm) * bm
    if a_rows < padded:
        a = jnp.pad(a, ((0, padded - a_rows), (0, 0)))
    kernel = _kernel(config, k_dim, n_dim, capacity, out_cols, transpose_w, kernel_name, interpret,
                     has_bias=bias is not None)
    num_real = jnp.sum(meta.num_rows > 0, dtype=jnp.int32).reshape(1)
    operands = (meta.expert, meta.row_start, meta.num_rows, num_real, a, w)
    return kernel(*operands, *(() if bias is None else (bias,)))


def _kernel(config: GroupedMatmulConfig, k_dim, n_dim, capacity, out_cols, transpose_w,
            kernel_name, interpret, has_bias: bool = False):
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    split_m = bm == 128
    mb = bm // 2 if split_m else bm  # rows per consumer
    num_sms = config.num_sms
    num_k = k_dim // bk
    grid_n = n_dim // bn
    dtype = jnp.bfloat16
    tf = _common.mma_transforms(dtype)

    def body(expert_ref, start_ref, rows_ref, nreal_ref, a_ref, w_ref, *rest):
        bias_ref, *rest = rest if has_bias else (None, *rest)
        out_ref, a_smem, b_smem, o_smem, full, empty, *bias_scratch = rest
        wg = jax.lax.axis_index("wg")
        sm = jax.lax.axis_index("sm")
        total = nreal_ref[0] * grid_n  # real work items
        my_items = jnp.maximum(total - sm + num_sms - 1, 0) // num_sms

        def item(j):
            w = sm + j * num_sms
            return w // grid_n, w % grid_n  # (tile, column block)

        @pl.when(wg == 2)
        def _producer():
            def per_item(j, carry):
                tile, ni = item(j)
                box0 = (start_ref[tile] // bm) * bm  # the aligned block holding the tile
                w_e = w_ref.at[expert_ref[tile]]
                c = 0 if split_m else j % 2

                def per_step(k, carry):
                    g = j * num_k + k
                    slot = g % stages

                    @pl.when(g >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])

                    k0 = k * bk
                    plgpu.copy_gmem_to_smem(  # [bm, bk]
                        a_ref.at[pl.ds(box0, bm), pl.ds(k0, bk)], a_smem.at[slot],
                        full.at[c, slot],
                    )
                    if transpose_w:  # [bn, bk], K-minor
                        w_tile = w_e.at[pl.ds(ni * bn, bn), pl.ds(k0, bk)]
                    else:  # [bk, bn]
                        w_tile = w_e.at[pl.ds(k0, bk), pl.ds(ni * bn, bn)]
                    plgpu.copy_gmem_to_smem(w_tile, b_smem.at[slot], full.at[c, slot])
                    return carry

                jax.lax.fori_loop(0, num_k, per_step, None)
                return carry

            jax.lax.fori_loop(0, my_items, per_item, None)
            # Observe the releases of the last `stages` steps too, so every barrier phase is
            # consumed before exit (interpret mode checks this).
            num_steps = my_items * num_k

            def drain(g, carry):
                plgpu.barrier_wait(empty.at[g % stages])
                return carry

            jax.lax.fori_loop(jnp.maximum(num_steps - stages, 0), num_steps, drain, None)

        for c in range(2):
            @pl.when(wg == c)
            def _consumer(c=c):
                bar_c = 0 if split_m else c
                a_rows = pl.ds(c * mb, mb) if split_m else slice(None)

                def per_item(i, carry):
                    j = i if split_m else 2 * i + c
                    tile, ni = item(j)
                    row0 = start_ref[tile]
                    num_rows = rows_ref[tile]
                    box0 = (row0 // bm) * bm
                    shift = row0 - box0  # box row of the tile's first row
                    if split_m:  # this consumer's box rows [c*mb, c*mb + mb) ∩ the tile's
                        lo = jnp.maximum(shift, c * mb)
                        count = jnp.maximum(jnp.minimum(shift + num_rows, c * mb + mb) - lo, 0)
                        dst0, src0 = box0 + lo, lo - c * mb
                    else:
                        count, dst0, src0 = num_rows, row0, shift
                    if has_bias:  # lands while the K loop runs
                        bias_smem, bias_bars = bias_scratch
                        plgpu.copy_gmem_to_smem(
                            bias_ref.at[expert_ref[tile], pl.ds(ni * bn, bn)], bias_smem.at[c],
                            bias_bars.at[c],
                        )

                    def mma_scope(acc):
                        def per_step(k, carry):
                            g = j * num_k + k
                            slot = g % stages
                            plgpu.barrier_wait(full.at[bar_c, slot])
                            b = b_smem.at[slot]
                            if transpose_w:
                                b = b.transpose((1, 0))
                            plgpu.wgmma(acc, a_smem.at[slot, a_rows], b)  # [mb,bk] @ [bk,bn]
                            plgpu.wgmma_wait(1)  # step g-1 is done: release its slot

                            @pl.when(k >= 1)
                            def _():
                                plgpu.barrier_arrive(empty.at[(g - 1) % stages])

                            return carry

                        jax.lax.fori_loop(0, num_k, per_step, None)
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(empty.at[(j * num_k + num_k - 1) % stages])
                        return acc[...]

                    y = pl.run_scoped(mma_scope, plgpu.ACC((mb, bn), jnp.float32))  # [mb, bn]
                    if has_bias:
                        plgpu.barrier_wait(bias_bars.at[c])
                        y = y + _common.bias_columns(bias_smem.at[c], mb)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous item's store
                    o_smem[c] = y.astype(dtype)
                    plgpu.commit_smem()
                    _common.store_rows(
                        o_smem.at[c], out_ref.at[:, pl.ds(ni * bn, bn)], dst0, count, mb,
                        src_row0=src0,
                    )
                    return carry

                num_mine = my_items if split_m else (my_items - c + 1) // 2
                jax.lax.fori_loop(0, num_mine, per_item, None)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    b_shape = (stages, bn, bk) if transpose_w else (stages, bk, bn)
    return plgpu.kernel(
        body,
        kernel_name=kernel_name,
        out_type=jax.ShapeDtypeStruct((capacity, out_cols), dtype),
        scratch_types=[
            plgpu.SMEM((stages, bm, bk), dtype, transforms=tf),
            plgpu.SMEM(b_shape, dtype, transforms=tf),
            plgpu.SMEM((2, mb, bn), dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=(1 if split_m else 2, stages)),
            plgpu.Barrier(num_arrivals=2 if split_m else 1, num_barriers=stages),
            # Per consumer: the item's bias columns and the barrier their copy arrives on.
            *((plgpu.SMEM((2, bn), dtype), plgpu.Barrier(num_barriers=2)) if has_bias else ()),
        ],
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_common.interpret_params(interpret),
    )
