"""Weight gradients: varlen-K grouped GEMMs with the token gather fused into the load.

    dW2[e] = A'[rows e]^T @ dO[tok[rows e]]      [E, n, d]   (`weight_grad(..., gathered="rhs")`)
    dW1[e] = X[tok[rows e]]^T @ dH[rows e]       [E, d, 2n]  (`weight_grad(..., gathered="lhs")`)

Both are `out[e] = L[rows e]^T @ R[rows e]`, contracting over expert e's rows only; one of L,
R is indexed by grouped row (contiguous: A' or dH) and the other by source token (gathered: dO
or X, through `plan.token_ids`).

One CTA computes one `[bm, bn]` output tile of one expert, walking that expert's rows in
K-blocks of `block_k` rows. K-blocks are aligned to `block_k` (Mosaic's tiled TMA wants
8-aligned row offsets), so the first and the last block of a group may hold rows of the
neighbouring experts or padding (unwritten, possibly non-finite): only those two blocks are
masked, by zeroing the contiguous operand's foreign rows in SMEM (`jnp.where`, never a
multiply). The gathered operand's foreign rows repeat rows of the group (ids are clamped into
the group once per plan in `k_block_ids`), so they are finite whenever the inputs are.

The gather: each row of a gathered K-block is a `[1, 64]` TMA copy into a 128-byte-swizzled
SMEM buffer (`row_gather_buffers`). The gathered side is split into chunks of 64 columns, one
buffer and one fp32 accumulator per chunk, so every chunk keeps the layout wgmma reads.
The token ids of each K-block are themselves TMA-prefetched into SMEM `num_stages` steps
ahead, so issuing the row copies never waits on a global load.

The kernel is warp-specialized (`_weight_grad_ws`): a producer warpgroup issues the copies
(the row copies from its 4 warps) and C consumer warpgroups (`WeightGradConfig.
num_consumers`) split the contiguous side's columns. (Session 22 removed the one-warpgroup
kernel that issued every copy and every wgmma itself: 70 against 282 TF/s on the H100 at the
7B shape, and no default used it.)

Empty experts run no K loop and store their zero accumulators: every output element is
written. The grid walks experts by decreasing group size (largest first), so the long
experts start early and the short ones fill the tail.

Work items are (expert, output tile) pairs; by default one CTA computes one. With
`WeightGradConfig.persistent_ctas` the same kernel runs as persistent CTAs that walk the
items in the same order (bitwise the same result): its producer runs into the next item's
K-steps while the consumers finish this one, and each consumer's output tile has its own SMEM
so its stores drain under the next K loop. Measured on an H200 (benchmarks/RESULTS.md,
session 23): level at 7B and 30B with separate output tiles (they leave room for 3 stages
instead of 4, which alone costs 4-8%; persistence wins that back), 1.04-1.07x where experts
hold ~1000 rows. Ablations at 7B: the group-edge masking costs ~14 us of dW1's ~577 and the
stores ~35; storing the output straight from registers (4 stages) was slower.
`WeightGradConfig.output_chunks=1` (session 24) keeps 4 stages beside one output buffer per
consumer, whose chunks take turns in it: on an H200 (session 25, same run, bitwise equal)
7B dW1 1.010x and dW2 1.019x, 30B 1.041x and 1.103x against one CTA per item; on the H100
(session 44, paired over 3 rounds) 7B dW1 1.060x and dW2 1.056x, 30B level and 1.034x (noisy).
It is every card's default (`BackwardConfig.for_shape`) where its stages fit beside the
buffers; one CTA per item is the default elsewhere.

Removed in session 64: `WeightGradConfig.wgmma_lag=0` (each slot released as soon as its own
K step's wgmmas are done; bitwise the default), dW2 0.989x and dW1 0.995x at gpt-oss's widths
on the H100 (session 64, 3 paired rounds, spreads 2.7% / 3.0%; at 30B dW2 0.985x / 0.960x,
dW1 1.045x / 0.987x in sessions 52 and 54); `benchmarks/history/session64/dh_weight_grad_lag0.patch`
restores it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.routing.plan import count_at_most

_CHUNK = 64  # columns of one gathered buffer: one 128-byte swizzle row of bf16


@dataclasses.dataclass(frozen=True)
class WeightGradConfig:
    """Block sizes of a weight-gradient kernel.

    Attributes:
      block_m: output rows per CTA (columns of L). Multiple of 64; when L is the gathered
        side it is split into `block_m // 64` chunks (one accumulator each).
      block_n: output columns per CTA (columns of R). Multiple of 64, at most 256; when R is
        the gathered side it is split into `block_n // 64` chunks.
      block_k: rows (of the contraction) per step; a multiple of 64.
      num_stages: SMEM pipeline depth.
      num_consumers: C >= 1 consumer warpgroups beside the producer warpgroup (which issues
        the copies, the gathered rows from its 4 warps); they share each gathered stage and
        split the
        contiguous side's columns, so a CTA covers `C * block_m` rows of the output when
        the contiguous side is L (`gathered="rhs"`), `C * block_n` columns otherwise.
      gather: how the producer gathers rows: "tma" (one `[1, 64]` TMA copy per row chunk;
        the loader interpret mode runs) or "cp_async" (16-byte cp.async loads from all 128
        producer threads, `_common.cp_async_gather_rows`; compiled kernels only, needs
        `num_stages >= 3`; interpret mode falls back to "tma"). Its stages are published
        by hardware-tracked mbarriers (`_common.cp_async_stage_barriers`: every stage in
        flight).
      gather_completion: "mbarrier", the only value (kept because the shared gather
        checks of `_common` read it; any other value is refused).
      rebalance_registers: the producer drops to 40 registers per thread and the consumers
        take the rest (`_common.role_registers`).
      persistent_ctas: 0 = one CTA per (expert, output tile) item. P > 0 = P persistent
        CTAs (e.g. the SM count) walk the items in the same order, CTA i taking items i,
        i + P, ...: the producer runs on into the next item's K-steps (and has its token
        ids in SMEM `num_stages` steps ahead) while the consumers finish this one, and each
        consumer's output tile has its own SMEM, whose stores drain under the next item's K
        loop. That SMEM no longer overlays the pipeline, so fewer stages fit (3 at the 7B
        defaults, 4 with `output_chunks=1`). Same products in the same order: bitwise the
        same result.
      output_chunks: persistent kernel only: how many of a consumer's output chunks (the
        [64, block_n] row blocks of a dW1 tile, the [block_m, 64] column blocks of a dW2
        tile: one per gathered chunk) have their own SMEM buffer; 0 = all of them. Must
        divide the chunk count. Fewer buffers leave room for another stage (at the 7B,
        30B and Qwen3 defaults, 4 stages beside one 16-KB buffer per consumer); before it
        rewrites a buffer the consumer waits until the store that last read it has read it.

    Session 63 removed `cluster_m` (neighbouring tiles of one expert on two CTAs of a cluster
    sharing each contiguous K-block by TMA multicast: bitwise the default but 0.98-1.02x at
    30B and 7B on the H100, session 51, paired: no gain;
    `benchmarks/history/session63/weight_grad_clusters.patch` restores it).
    Session 63 also removed `expert_major=False` (tile-major items: one tile of every expert
    before the next tile, so each tile re-read its expert's rows from DRAM; expert-major took
    dW1 1064 -> 652 us and dW2 536 -> 365 us on the H100 at 7B, session 4) and
    `gather_completion="wait_group"` (the lagged cp.async publish: dW1 615 / 4164 us against
    mbarrier's 575 / 3877, dW2 335 / 2086 against 323 / 1933 on the H100 at 7B / 30B, session
    4; dW2 0.931x / 0.898x paired on the H200, session 39);
    `benchmarks/history/session63/weight_grad_order_completion.patch` restores both. Items
    are always expert-major (the largest expert first). Session 64 removed `wgmma_lag`
    (each consumer releases a K step's slot once the next step's wgmmas are issued and its
    own are done, `_common.consumer_k_loop`'s lag 1; see the module docstring).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    num_consumers: int = 1
    gather: str = "tma"
    rebalance_registers: bool = True
    gather_completion: str = "mbarrier"
    persistent_ctas: int = 0
    output_chunks: int = 0

    def __post_init__(self):
        if self.gather_completion != "mbarrier":
            raise ValueError(
                f"config.gather_completion={self.gather_completion!r}: the weight gradients "
                'publish cp.async stages by mbarrier only ("wait_group" was removed in '
                "session 63: slower on the H100 and the H200)."
            )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["order", "row_lo", "row_hi", "block_off", "block_ids"],
    meta_fields=["block_k"],
)
@dataclasses.dataclass(frozen=True)
class KBlockMeta:
    """Per-expert K-blocks of a varlen-K GEMM, computed once per plan and block_k.

    Expert e's rows `[row_lo[e], row_hi[e])` are covered by the aligned K-blocks
    `row_lo[e] // bk + i`, `i < num_blocks(e)`; block i of e is entry `block_off[e] + i` of
    `block_ids`.

    Attributes:
      order: i32[E] experts by decreasing group size (the grid's expert order).
      row_lo, row_hi: i32[E] first and one-past-last grouped row of each expert.
      block_off: i32[E + 1] first entry of each expert's K-blocks in `block_ids`.
      block_ids: i32[num_blocks, bk] source token of each row of each K-block; rows outside
        the expert's group repeat its nearest row of the group.
      block_k: static rows per K-block.
    """

    order: jax.Array
    row_lo: jax.Array
    row_hi: jax.Array
    block_off: jax.Array
    block_ids: jax.Array
    block_k: int


def k_block_meta(group_sizes: jax.Array, token_ids: jax.Array, block_k: int) -> KBlockMeta:
    """K-blocks of every expert (at most `ceil(P / bk) + E` in all) and their token ids."""
    capacity = token_ids.shape[0]
    num_experts = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    hi = jnp.cumsum(sizes, dtype=jnp.int32)  # [E]
    lo = hi - sizes
    blocks = jnp.where(sizes > 0, (hi + block_k - 1) // block_k - lo // block_k, 0)  # [E]
    block_off = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(blocks, dtype=jnp.int32)])
    max_blocks = -(-capacity // block_k) + num_experts
    b = jnp.arange(max_blocks, dtype=jnp.int32)
    owner = jnp.minimum(count_at_most(block_off[1:], b), num_experts - 1)
    first_row = (lo[owner] // block_k + b - block_off[owner]) * block_k  # [nb]
    rows = first_row[:, None] + jnp.arange(block_k, dtype=jnp.int32)[None, :]  # [nb, bk]
    rows = jnp.clip(rows, lo[owner][:, None], hi[owner][:, None] - 1)
    rows = jnp.clip(rows, 0, capacity - 1)
    block_ids = token_ids.astype(jnp.int32)[rows]
    # Experts by decreasing size, ties by index (a stable argsort of -sizes): each expert's
    # place is a count over the E x E pairs, one fused reduction instead of a sort.
    expert = jnp.arange(num_experts, dtype=jnp.int32)
    ahead = (sizes[None, :] > sizes[:, None]) | (
        (sizes[None, :] == sizes[:, None]) & (expert[None, :] < expert[:, None])
    )  # [E(e), E(e')]: e' goes before e
    place = jnp.sum(ahead, axis=1, dtype=jnp.int32)  # [E], a permutation
    order = jnp.zeros((num_experts,), jnp.int32).at[place].set(expert, unique_indices=True)
    return KBlockMeta(order, lo, hi, block_off, block_ids, block_k)


def weight_grad(
    lhs: jax.Array,
    rhs: jax.Array,
    token_ids: jax.Array,
    group_sizes: jax.Array,
    *,
    gathered: str,
    out_dtype,
    config: WeightGradConfig = WeightGradConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: KBlockMeta | None = None,
) -> jax.Array:
    """`out[e] = L[rows e]^T @ R[rows e]`, with L or R gathered by token.

    Args:
      lhs: bf16 L. `[T, M]` (indexed by token) if `gathered == "lhs"`, else `[P_pad, M]`
        (indexed by grouped row, `P_pad >= P` a multiple of block_k).
      rhs: bf16 R, `[T, N]` if `gathered == "rhs"`, else `[P_pad, N]`.
      token_ids: i32 [P] source token of each grouped row (plan.token_ids).
      group_sizes: i32 [E] rows per expert (plan.group_sizes).
      gathered: "lhs" (dW1: L = X, R = dH) or "rhs" (dW2: L = A', R = dO).
      out_dtype: dtype of the result (the weights' dtype).
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.
      meta: precomputed `k_block_meta(group_sizes, token_ids, config.block_k)`.

    Returns:
      out_dtype [E, M, N]; experts without rows get exact zeros.
    """
    if gathered not in ("lhs", "rhs"):
        raise ValueError(f'gathered must be "lhs" or "rhs", got {gathered!r}.')
    if lhs.ndim != 2 or rhs.ndim != 2:
        raise ValueError(
            f"lhs and rhs must be 2-D, got {tuple(lhs.shape)} and {tuple(rhs.shape)}."
        )
    _common.require_dtype("lhs", lhs, jnp.bfloat16)
    _common.require_dtype("rhs", rhs, jnp.bfloat16)
    capacity = token_ids.shape[0]
    num_experts = group_sizes.shape[0]
    m_dim, n_dim = lhs.shape[1], rhs.shape[1]
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    _common.require_multiple("config.block_m", bm, 64, "wgmma tiles M by 64")
    _common.require_multiple("config.block_n", bn, 64, "B tiles are 128-byte swizzled")
    _common.require_multiple("config.block_k", bk, 64, "K-blocks hold whole 8-row tiles")
    if bn > 256:
        raise ValueError(f"config.block_n={bn} must be at most 256 (one wgmma N).")
    if stages < 2:
        raise ValueError(f"config.num_stages={stages} must be >= 2.")
    if config.num_consumers < 1:
        raise ValueError(
            f"config.num_consumers={config.num_consumers} must be >= 1 (consumer warpgroups "
            "beside the producer)."
        )
    _common.require_gather_mode(config)
    if config.persistent_ctas < 0:
        raise ValueError(
            f"config.persistent_ctas={config.persistent_ctas} must be >= 0 (0: one CTA per "
            "output tile; P > 0: P persistent CTAs)."
        )
    chunks = (bm if gathered == "lhs" else bn) // _CHUNK
    if config.output_chunks and (not config.persistent_ctas or config.output_chunks < 0
                                 or chunks % config.output_chunks):
        raise ValueError(
            f"config.output_chunks={config.output_chunks} needs persistent_ctas > 0 and must "
            f"divide the {chunks} output chunks per consumer (block_"
            f"{'m' if gathered == 'lhs' else 'n'} / 64), or be 0 (all)."
        )
    cons = config.num_consumers
    cta_m = bm * (cons if gathered == "rhs" else 1)  # consumers split the contiguous side
    cta_n = bn * (cons if gathered == "lhs" else 1)
    _common.require_multiple("M (lhs.shape[1])", m_dim, cta_m, f"a CTA computes {cta_m} rows")
    _common.require_multiple("N (rhs.shape[1])", n_dim, cta_n, f"a CTA computes {cta_n} columns")
    smem = persistent_smem_bytes(config, gathered, jnp.dtype(out_dtype).itemsize)
    if config.persistent_ctas and smem > PERSISTENT_SMEM_BUDGET:
        raise ValueError(
            f"config needs {smem} bytes of SMEM ({config.num_stages} stages and separate "
            "output buffers per consumer, as persistent_ctas > 0 has), more than the "
            f"{PERSISTENT_SMEM_BUDGET} a CTA has: lower config.num_stages or "
            "config.output_chunks."
        )
    contiguous = rhs if gathered == "lhs" else lhs
    name = "rhs" if gathered == "lhs" else "lhs"
    rows_pad = -(-capacity // bk) * bk
    if contiguous.shape[0] < rows_pad:
        raise ValueError(
            f"{name}.shape[0]={contiguous.shape[0]} must be at least P={capacity} rounded up to "
            f"block_k={bk} ({rows_pad}): whole aligned K-blocks are loaded."
        )
    if meta is None:
        meta = k_block_meta(group_sizes, token_ids, bk)
    if meta.block_k != bk:
        raise ValueError(f"meta.block_k={meta.block_k} must equal config.block_k={bk}.")
    interpret_mode = _common.interpret_params(interpret)
    args = (meta.order, meta.row_lo, meta.row_hi, meta.block_off, meta.block_ids, lhs, rhs)
    kernel = _weight_grad_ws(
        config, gathered, m_dim, n_dim, num_experts, jnp.dtype(out_dtype), interpret_mode
    )
    return kernel(*args)


# What `persistent_smem_bytes` may take: a CTA's dynamic SMEM less its barriers and
# Pallas' own scratch (1120 bytes at the 7B defaults, by lowering).
PERSISTENT_SMEM_BUDGET = 232448 - 2048


def persistent_smem_bytes(config: WeightGradConfig, gathered: str, out_itemsize: int) -> int:
    """SMEM of a persistent weight-gradient CTA: the stages (gathered chunks, contiguous
    K-block, token ids) and the consumers' own output buffers (`output_chunks` of the
    tile's chunks each). (One CTA per item overlays its tile on the stages.)"""
    bm, bn, bk, cons = config.block_m, config.block_n, config.block_k, config.num_consumers
    if gathered == "lhs":
        gathered_cols, contiguous_cols = bm, cons * bn
    else:
        gathered_cols, contiguous_cols = bn, cons * bm
    chunks = gathered_cols // _CHUNK
    buffers = config.output_chunks or chunks
    stage = bk * (gathered_cols + contiguous_cols) * 2 + bk * 4
    return config.num_stages * stage + cons * (bm * bn // chunks) * buffers * out_itemsize


def _mask_foreign_rows(ref, k0, lo, hi):
    """Zeroes the rows of a contiguous K-block in SMEM (rows `k0 + i`) outside `[lo, hi)`."""
    layout = plgpu.Layout.WGMMA
    vals = plgpu.load(ref, layout=layout, optimized=False)
    rows = plgpu.broadcasted_iota(jnp.int32, vals.shape, 0, layout=layout) + k0
    keep = (rows >= lo) & (rows < hi)
    ref[...] = jnp.where(keep, vals, jnp.zeros_like(vals))
    plgpu.commit_smem()  # fence + warpgroup barrier: visible to the wgmma that follows


def _weight_grad_ws(config: WeightGradConfig, gathered: str, m_dim: int, n_dim: int,
                    num_experts: int, out_dtype, interpret_mode):
    """The weight gradient as one producer warpgroup + `config.num_consumers` consumers.

    Work items are (expert, output tile) pairs, numbered expert-major (`item = e * tiles +
    tile`, e in `order`, the largest expert first).
    One CTA per item, or `config.persistent_ctas` CTAs where CTA i takes items i, i + C, ...

    Producer (warpgroup C): walks its items' K-steps as one run of global steps g (slot
    g % stages). Per step it waits until the consumers released the slot (`empty`), waits
    for the step's token ids, issues the contiguous K-block (`[bk, C * b]`, all consumers'
    columns) and the gathered rows (cp.async from all 128 threads, or one `[1, 64]` TMA copy
    per row and chunk from its 4 warps), all arriving on `full[slot]`; then (after a
    warpgroup barrier: every thread has read the ids slot) it refills the ids slot with the
    ids of the step `stages` steps ahead, which may lie in a later item (a cursor over the
    CTA's items that skips empty experts). So a persistent CTA's next item starts loading
    while the consumers finish this one, and its first ids are in SMEM long before.
    Consumer c < C: per item, waits `full[slot]`, masks its own columns of the contiguous
    block on the group's first and last K-block, issues one wgmma per gathered chunk, and
    releases each slot once the next step's wgmmas are issued (the item's last slot after
    its K loop). Then it stores its own output tile: one CTA per item writes it into the
    pipeline's bytes (every consumer done first); a persistent CTA has separate buffers per
    consumer (`output_chunks` of the tile's chunks, default all), whose TMA stores drain
    while the next item's K loop runs (before it rewrites a buffer, the consumer waits only
    until the store that last read it has read it).
    """
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    cons = config.num_consumers
    gather_lhs = gathered == "lhs"
    chunks = (bm if gather_lhs else bn) // _CHUNK
    cta_m = bm * (1 if gather_lhs else cons)
    cta_n = bn * (cons if gather_lhs else 1)
    grid_m = m_dim // cta_m
    grid_n = n_dim // cta_n
    num_tiles = grid_m * grid_n
    num_items = num_experts * num_tiles
    persistent = config.persistent_ctas > 0
    buffers = (config.output_chunks or chunks) if persistent else chunks  # output buffers
    num_ctas = min(config.persistent_ctas, num_items) if persistent else num_items
    dtype = jnp.bfloat16
    tf = _common.mma_transforms(dtype)
    rows_per_warp = bk // 4
    # Interpret mode cannot run cp.async: it runs the same kernel with the TMA row loader.
    cp_async = config.gather == "cp_async" and interpret_mode is None

    def body(order_ref, lo_ref, hi_ref, off_ref, ids_ref, l_ref, r_ref, out_ref, *scratch):
        if persistent:
            ids_smem, bufs, o_smem, full, empty, ids_bars, *a_landed = scratch
            g_copy, g_mma, (c_smem,), () = views(bufs)
        else:
            ids_smem, bufs, full, empty, ids_bars, epi_bar, *a_landed = scratch
            g_copy, g_mma, (c_smem,), (o_smem,) = views(bufs)
        if cp_async:  # a_landed[0]: per-slot mbarriers the cp.async loads complete
            _common.cp_async_stage_barriers_init(a_landed[0])
        wg = jax.lax.axis_index("wg")
        cta = jax.lax.axis_index("cta")
        my_items = (num_items - cta + num_ctas - 1) // num_ctas  # >= 1: num_ctas <= items

        def item(j):  # (expert, first output row, first output column) of item j of this CTA
            w = cta + j * num_ctas
            e, t = w // num_tiles, w % num_tiles
            return order_ref[e], (t // grid_n) * cta_m, (t % grid_n) * cta_n

        def k_blocks(expert):  # (first entry in ids_ref, K-blocks) of an expert's rows
            return off_ref[expert], off_ref[expert + 1] - off_ref[expert]

        g_ref = l_ref if gather_lhs else r_ref
        c_ref = r_ref if gather_lhs else l_ref

        @pl.when(wg == cons)
        def _producer():
            if config.rebalance_registers:
                _common.role_registers("producer", cons)

            def advance(cursor):  # the step after (item j, step ki), skipping empty items
                def past_item(c):
                    j, ki = c
                    _, steps = k_blocks(item(jnp.minimum(j, my_items - 1))[0])
                    return (j < my_items) & (ki >= steps)

                j, ki = cursor
                return jax.lax.while_loop(past_item, lambda c: (c[0] + 1, jnp.int32(0)),
                                          (j, ki + 1))

            def issue_ids(cursor, slot):  # the token ids of the step at `cursor`, if any
                j, ki = cursor

                @pl.when(j < my_items)
                def _():
                    block0, _ = k_blocks(item(j)[0])
                    plgpu.copy_gmem_to_smem(ids_ref.at[block0 + ki], ids_smem.at[slot],
                                            ids_bars.at[slot])

            ahead = advance((jnp.int32(0), jnp.int32(-1)))  # the CTA's first step
            for s in range(stages):
                issue_ids(ahead, s)
                ahead = advance(ahead)

            def per_item(j, carry):
                expert, m0, n0 = item(j)
                kb0 = lo_ref[expert] // bk  # first aligned K-block of the group
                _, num_k = k_blocks(expert)
                g_col0 = m0 if gather_lhs else n0

                def step(ki, carry):
                    g, ahead = carry
                    slot = g % stages
                    k0 = (kb0 + ki) * bk

                    @pl.when(g >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])

                    if gather_lhs:  # [bk, C*bn] of dH
                        c_src = c_ref.at[pl.ds(k0, bk), pl.ds(n0, cta_n)]
                    else:  # [bk, C*bm] of A'
                        c_src = c_ref.at[pl.ds(k0, bk), pl.ds(m0, cta_m)]
                    plgpu.copy_gmem_to_smem(c_src, c_smem.at[slot], full.at[slot])
                    plgpu.barrier_wait(ids_bars.at[slot])

                    def per_warp(w):
                        _common.gather_rows(  # [1, 64] chunks of X[tok] or dO[tok] per row
                            g_ref, ids_smem.at[slot],
                            [g_copy.at[slot * chunks + j] for j in range(chunks)],
                            full.at[slot], col0=g_col0, width=_CHUNK,
                            first_row=w * rows_per_warp, num_rows=rows_per_warp, unroll=4,
                        )

                    if cp_async:
                        _common.cp_async_gather_rows(  # [bk, 64] per chunk of X or dO rows
                            g_ref.at[:, pl.ds(g_col0, chunks * _CHUNK)], ids_smem.at[slot],
                            [g_mma.at[slot * chunks + j] for j in range(chunks)], num_rows=bk,
                        )
                        _common.cp_async_publish(g, full, a_landed, stages)
                    else:
                        plgpu.warp_map(per_warp)

                    @pl.when(ahead[0] < my_items)
                    def _():
                        plgpu.commit_smem()  # every thread has read the ids slot
                        issue_ids(ahead, slot)

                    return g + 1, advance(ahead)

                return jax.lax.fori_loop(0, num_k, step, carry)

            total, _ = jax.lax.fori_loop(0, my_items, per_item, (jnp.int32(0), ahead))
            if cp_async:
                @pl.when(total > 0)
                def _():
                    _common.cp_async_publish_rest(total, full, a_landed, stages)

            # Observe the releases of the last `stages` steps, so every phase is consumed.
            for s in range(stages):
                @pl.when(total - stages + s >= 0)
                def _():
                    plgpu.barrier_wait(empty.at[(total - stages + s) % stages])

        for c in range(cons):
            @pl.when(wg == c)
            def _consumer(c=c):
                if config.rebalance_registers:
                    _common.role_registers("consumer", cons)

                def per_item(j, g0):
                    expert, m0, n0 = item(j)
                    lo, hi = lo_ref[expert], hi_ref[expert]
                    kb0 = lo // bk
                    _, num_k = k_blocks(expert)

                    def mma_scope(*accs):
                        def own(slot):  # this consumer's columns of the contiguous K-block
                            return c_smem.at[slot, :, pl.ds(c * (bn if gather_lhs else bm),
                                                            bn if gather_lhs else bm)]

                        def wait(g, slot):  # landed, then rows outside [lo, hi) zeroed
                            k0 = (kb0 + g - g0) * bk
                            plgpu.barrier_wait(full.at[slot])
                            _common.cp_async_consumer_wait(g, a_landed, stages)

                            @pl.when((k0 < lo) | (k0 + bk > hi))
                            def _():
                                _mask_foreign_rows(own(slot), k0, lo, hi)

                        def mma(slot):
                            for j in range(chunks):
                                g_tile = g_mma.at[slot * chunks + j]  # [bk, 64]
                                if gather_lhs:  # [64, bk] @ [bk, bn]
                                    plgpu.wgmma(accs[j], g_tile.transpose((1, 0)), own(slot))
                                else:  # [bm, bk] @ [bk, 64]
                                    plgpu.wgmma(accs[j], own(slot).transpose((1, 0)), g_tile)

                        _common.consumer_k_loop(num_k, stages, wait, mma, empty,
                                                mmas_per_step=chunks,
                                                step_of=lambda ki: g0 + ki)

                        @pl.when(num_k > 0)
                        def _():
                            plgpu.barrier_arrive(empty.at[(g0 + num_k - 1) % stages])

                        return tuple(acc[...] for acc in accs)

                    acc_shape = (_CHUNK, bn) if gather_lhs else (bm, _CHUNK)
                    accs = pl.run_scoped(
                        mma_scope, *[plgpu.ACC(acc_shape, jnp.float32) for _ in range(chunks)]
                    )
                    def dst(j):  # chunk j of this consumer's output tile
                        if gather_lhs:
                            return out_ref.at[expert, pl.ds(m0 + j * _CHUNK, _CHUNK),
                                              pl.ds(n0 + c * bn, bn)]
                        return out_ref.at[expert, pl.ds(m0 + c * bm, bm),
                                          pl.ds(n0 + j * _CHUNK, _CHUNK)]

                    if persistent:  # chunk j in buffer j % buffers, stored at once
                        for j in range(chunks):
                            # The `buffers - 1` stores since this buffer's last use may
                            # still read theirs; the one before them has read this one.
                            plgpu.wait_smem_to_gmem(buffers - 1, wait_read_only=True)
                            o_smem[c, j % buffers] = accs[j].astype(out_dtype)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(o_smem.at[c, j % buffers], dst(j))
                    else:  # the tile reuses the pipeline's SMEM: every consumer is done
                        plgpu.barrier_arrive(epi_bar)
                        plgpu.barrier_wait(epi_bar)
                        for j in range(chunks):
                            o_smem[c, j] = accs[j].astype(out_dtype)
                        plgpu.commit_smem()
                        for j in range(chunks):
                            plgpu.copy_smem_to_gmem(o_smem.at[c, j], dst(j))
                    return g0 + num_k

                jax.lax.fori_loop(0, my_items, per_item, jnp.int32(0))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    c_shape = (stages, bk, cta_n) if gather_lhs else (stages, bk, cta_m)
    o_type = plgpu.SMEM(  # per consumer: the output tile, or (persistent) its buffers
        (cons, buffers, _CHUNK, bn) if gather_lhs else (cons, buffers, bm, _CHUNK), out_dtype)
    bufs, views = _common.gathered_pipeline_smem(
        (stages * chunks, bk, _CHUNK), dtype,
        others=[plgpu.SMEM(c_shape, dtype, transforms=tf)],  # contiguous K-blocks
        epilogue=[] if persistent else [o_type],
        interpret=interpret_mode is not None,
    )
    scratch = [
        plgpu.SMEM((stages, bk), jnp.int32),  # token ids of each stage's K-block
        bufs,  # gathered chunks [stages * chunks, bk, 64] + contiguous K-blocks (+ output)
        *([o_type] if persistent else []),
        # full: the contiguous block plus what the row loader adds (TMA: one per row and
        # chunk)
        plgpu.Barrier(
            num_arrivals=_common.gather_full_arrivals(
                config, bk * chunks, interpret_mode is not None
            ) + 1,
            num_barriers=stages,
        ),
        plgpu.Barrier(num_arrivals=cons, num_barriers=stages),  # empty: the consumers
        plgpu.Barrier(num_barriers=stages),  # ids
        *([] if persistent else [plgpu.Barrier(num_arrivals=cons)]),  # done with the pipeline
        *([_common.cp_async_stage_barriers(stages)] if cp_async else []),
    ]
    return plgpu.kernel(
        body,
        kernel_name=f"moe_weight_grad_{gathered}",
        out_type=jax.ShapeDtypeStruct((num_experts, m_dim, n_dim), out_dtype),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=cons + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_mode,
    )
