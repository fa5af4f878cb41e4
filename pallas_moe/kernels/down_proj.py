"""Down-projection: varlen-M grouped GEMM over rows already grouped by expert.

    Y[r] = A[r] @ W2[e(r)]        A bf16 [P, n], W2 bf16 [E, n, d] -> Y bf16 [P, d]

One CTA computes one (row tile, column block) pair. A is contiguous here, so each stage is
one `[block_m, block_k]` TMA box; Mosaic's tiled TMA needs the box's first row to be a
multiple of 8, so tiles come from `aligned_tile_meta` (computed once per plan): a tile is a
piece of one expert's rows inside one `block_m`-aligned block, and its CTA loads the whole
aligned block. Rows of the box outside the tile (other experts, padding) are multiplied like
the rest and then dropped: the epilogue TMA-stores only the tile's rows (`store_rows`), so a
tile never writes another expert's rows. Same `num_stages`-deep pipeline as the up-proj.
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
class DownProjConfig:
    """Block sizes of the down-proj kernel.

    Attributes:
      block_m: rows per tile (multiple of 64).
      block_n: output columns per CTA (multiple of 64, divides d, at most 256).
      block_k: contraction step over n; must be 64 and divide n.
      num_stages: SMEM pipeline depth.
      num_sms: 0 = one CTA per (tile, column block), single warpgroup. > 0 = persistent
        ping-pong kernel on `num_sms` CTAs (`_persistent_kernel`): a producer warpgroup
        streams the K steps of the CTA's work items back to back, and two consumer
        warpgroups take alternate items, so one's epilogue overlaps the other's wgmmas.
    """

    block_m: int = 64
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 4
    num_sms: int = 0


def down_proj(
    a: jax.Array,
    group_sizes: jax.Array,
    w_down: jax.Array,
    *,
    config: DownProjConfig = DownProjConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: TileMeta | None = None,
    capacity: int | None = None,
    out_cols: int | None = None,
) -> jax.Array:
    """Grouped down-projection.

    Args:
      a: bf16 [P_a, n] activations in grouped row order (the up-proj's A). `P_a` may exceed
        the plan's capacity P (the up-proj pads A to a multiple of block_m, which saves a
        copy here); extra rows are ignored.
      group_sizes: i32 [E] rows per expert; rows past the sum are padding.
      w_down: bf16 [E, n, d].
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.
      meta: precomputed `aligned_tile_meta(group_sizes, capacity, config.block_m)`;
        computed here if None.
      capacity: the plan's row capacity P (default a.shape[0]).
      out_cols: width of the returned array (default d); columns past d are not written.

    Returns:
      y: bf16 [P, out_cols]. Padding rows are not written (their contents are unspecified).
    """
    if a.ndim != 2:
        raise ValueError(f"a must be [P, n], got shape {tuple(a.shape)}.")
    if w_down.ndim != 3:
        raise ValueError(f"w_down must be [E, n, d], got shape {tuple(w_down.shape)}.")
    _common.require_dtype("a", a, jnp.bfloat16)
    _common.require_dtype("w_down", w_down, jnp.bfloat16)
    a_rows, n = a.shape
    capacity = a_rows if capacity is None else capacity
    if capacity > a_rows:
        raise ValueError(f"capacity={capacity} exceeds a.shape[0]={a_rows}.")
    num_experts, n2, d = w_down.shape
    if n2 != n:
        raise ValueError(f"w_down.shape[1]={n2} must equal a.shape[1]={n}.")
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    _common.require_wgmma_blocks(config, "output tiles are 128-byte swizzled")
    _common.require_multiple("n (w_down.shape[1])", n, bk, f"the K loop steps by block_k={bk}")
    _common.require_multiple("d (w_down.shape[2])", d, bn, f"a CTA computes block_n={bn} columns")
    out_cols = d if out_cols is None else out_cols
    if out_cols < d:
        raise ValueError(f"out_cols={out_cols} must be >= d={d}.")
    if meta is None:
        meta = _common.aligned_tile_meta(group_sizes, capacity, bm)
    if meta.block_m != bm:
        raise ValueError(f"meta.block_m={meta.block_m} must equal config.block_m={bm}.")
    # Each tile loads its whole aligned block: make `a` a whole number of blocks.
    padded = -(-capacity // bm) * bm
    if a_rows < padded:
        a = jnp.pad(a, ((0, padded - a_rows), (0, 0)))
    num_k = n // bk
    grid_n = d // bn
    dtype = a.dtype
    tf = _common.mma_transforms(dtype)
    if config.num_sms:
        kernel = _persistent_kernel(config, n, d, capacity, out_cols, meta.num_tiles, interpret)
        num_real = jnp.sum(meta.num_rows > 0, dtype=jnp.int32).reshape(1)
        return kernel(meta.expert, meta.row_start, meta.num_rows, num_real, a, w_down)

    def body(expert_ref, start_ref, rows_ref, a_ref, w_ref, y_out, a_smem, b_smem, o_smem, bars):
        ni = jax.lax.axis_index("n")
        mi = jax.lax.axis_index("m")
        num_rows = rows_ref[mi]

        @pl.when(num_rows > 0)
        def _():
            expert = expert_ref[mi]
            row0 = start_ref[mi]
            box0 = (row0 // bm) * bm  # the aligned block holding the tile
            shift = row0 - box0  # SMEM row of the tile's first row
            w_e = w_ref.at[expert]  # [n, d]

            def issue(ki, slot):
                k0 = ki * bk
                plgpu.copy_gmem_to_smem(  # [bm, bk]
                    a_ref.at[pl.ds(box0, bm), pl.ds(k0, bk)], a_smem.at[slot], bars.at[slot]
                )
                plgpu.copy_gmem_to_smem(  # [bk, bn]
                    w_e.at[pl.ds(k0, bk), pl.ds(ni * bn, bn)], b_smem.at[slot], bars.at[slot]
                )

            def mma_scope(acc):
                def mma(slot):
                    plgpu.wgmma(acc, a_smem.at[slot], b_smem.at[slot])  # [bm,bk] @ [bk,bn]

                _common.k_pipeline(num_k, stages, bars, issue, mma, mmas_per_step=1)
                return acc[...]

            y = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn), jnp.float32))  # [bm, bn] f32
            o_smem[0] = y.astype(dtype)
            plgpu.commit_smem()
            _common.store_rows(
                o_smem.at[0], y_out.at[:, pl.ds(ni * bn, bn)], row0, num_rows, bm, src_row0=shift
            )
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        kernel_name="moe_down_proj",
        out_type=jax.ShapeDtypeStruct((capacity, out_cols), dtype),
        scratch_types=[
            plgpu.SMEM((stages, bm, bk), dtype, transforms=tf),
            plgpu.SMEM((stages, bk, bn), dtype, transforms=tf),
            plgpu.SMEM((1, bm, bn), dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ],
        grid=(grid_n, meta.num_tiles),
        grid_names=("n", "m"),
        interpret=_common.interpret_params(interpret),
    )
    return kernel(meta.expert, meta.row_start, meta.num_rows, a, w_down)


def _persistent_kernel(config: DownProjConfig, n, d, capacity, out_cols, num_tiles, interpret):
    """Persistent ping-pong down-proj: 1 producer + 2 consumer warpgroups per CTA.

    Work item w = (tile w // grid_n, column block w % grid_n); CTA s takes items
    s, s + num_sms, ... over the real tiles (`aligned_tile_meta` puts them first). Its j-th
    item is computed by consumer j % 2. The producer issues every K step of every item in
    order into a `num_stages`-slot ring: step g uses slot g % num_stages, waits `empty[slot]`
    (released by whichever consumer read the slot's previous contents) and arrives on
    `full[j % 2, slot]`, so each consumer waits only on its own barriers and its phase
    tracking stays exact. Each consumer has its own epilogue tile in SMEM.

    With `block_m == 128` the consumers instead share every item (split M): consumer c
    multiplies rows [64c, 64c + 64) of the A box by the same B tile, so each weight tile
    streamed from L2 feeds 128 rows instead of 64 (the 64-row kernel is L2-bandwidth bound:
    ~19 KB of operands per MFLOP vs ~11 KB here); both consumers release each slot.
    """
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    if bm not in (64, 128):
        raise ValueError(f"config.block_m={bm} must be 64 or 128 for the persistent kernel.")
    split_m = bm == 128
    mb = bm // 2 if split_m else bm  # rows per consumer
    num_sms = config.num_sms
    num_k = n // bk
    grid_n = d // bn
    dtype = jnp.bfloat16
    tf = _common.mma_transforms(dtype)

    def body(expert_ref, start_ref, rows_ref, nreal_ref, a_ref, w_ref, y_out,
             a_smem, b_smem, o_smem, full, empty):
        wg = jax.lax.axis_index("wg")
        sm = jax.lax.axis_index("sm")
        total = nreal_ref[0] * grid_n  # real work items
        my_items = jnp.maximum(total - sm + num_sms - 1, 0) // num_sms

        def item(j):
            w = sm + j * num_sms
            tile = w // grid_n
            return tile, w % grid_n

        @pl.when(wg == 2)
        def _producer():
            def per_item(j, carry):
                tile, ni = item(j)
                box0 = (start_ref[tile] // bm) * bm  # the aligned block holding the tile
                w_e = w_ref.at[expert_ref[tile]]  # [n, d]
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
                    plgpu.copy_gmem_to_smem(  # [bk, bn]
                        w_e.at[pl.ds(k0, bk), pl.ds(ni * bn, bn)], b_smem.at[slot],
                        full.at[c, slot],
                    )
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

                    def mma_scope(acc):
                        def per_step(k, carry):
                            g = j * num_k + k
                            slot = g % stages
                            plgpu.barrier_wait(full.at[bar_c, slot])
                            plgpu.wgmma(acc, a_smem.at[slot, a_rows], b_smem.at[slot])  # [mb,bk]@[bk,bn]
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
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous item's store
                    o_smem[c] = y.astype(dtype)
                    plgpu.commit_smem()
                    _common.store_rows(
                        o_smem.at[c], y_out.at[:, pl.ds(ni * bn, bn)], dst0, count, mb,
                        src_row0=src0,
                    )
                    return carry

                num_mine = my_items if split_m else (my_items - c + 1) // 2
                jax.lax.fori_loop(0, num_mine, per_item, None)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(
        body,
        kernel_name="moe_down_proj",
        out_type=jax.ShapeDtypeStruct((capacity, out_cols), dtype),
        scratch_types=[
            plgpu.SMEM((stages, bm, bk), dtype, transforms=tf),
            plgpu.SMEM((stages, bk, bn), dtype, transforms=tf),
            plgpu.SMEM((2, mb, bn), dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=(1 if split_m else 2, stages)),
            plgpu.Barrier(num_arrivals=2 if split_m else 1, num_barriers=stages),
        ],
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_common.interpret_params(interpret),
    )
