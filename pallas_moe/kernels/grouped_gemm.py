"""The persistent varlen-M grouped GEMM over rows already grouped by expert.

    out[r] = A[r] @ W[e(r)]          A bf16 [P_a, K], W bf16 [E, K, N]   (`transpose_w=False`)
    out[r] = A[r] @ W[e(r)]^T        A bf16 [P_a, K], W bf16 [E, N, K]   (`transpose_w=True`)
    (+ bias[e(r)])                   optional bias bf16 [E, N], added in fp32 before rounding

Three kernels are specs on it: the forward's down-proj (`Y = A @ W2[e] + b2[e]`,
`down_proj.py`), the backward's dX~ (`dX~ = dH @ W1[e]^T`, `dx.py`, which reads the public
`[E, d, 2n]` layout as is by feeding K-minor weight tiles to wgmma transposed) and the split
dH's GEMM (`dA' = dO[tok] @ W2[e]^T`, gathered, f32 out; `dh.dh_split`).

The fp8 mode (e4m3 A and W, f32 accumulation; the quantized inference path, `pallas_moe/quant/`)
runs the same pipeline with 128-element (128-byte) K steps. 8-bit wgmma takes B only
K-major, so W is `[E, N, K]` (`transpose_w=True`), and the epilogue dequantizes:

    out[r, j] = acc[r, j] * row_scales[r] * col_scales[e(r), j]                  (fp8)
    out[r, j] = swiglu(dequantized gate[r, j], dequantized up[r, j])    (fp8, `gated`)

The int8 mode (int8 A and W: W8A8 SmoothQuant) is the same pipeline and epilogue: s8 x s8
wgmma sums exactly in an s32 accumulator (|sum| <= K * 128^2 < 2^31 for K <= 131,072,
checked), which the epilogue converts to f32 (one rounding) before it dequantizes. It needs no promotion
(`fp8_promote_every` is ignored); the gathered mode and `gated` work as with e4m3.

With `gated`, W is `[E, 2N, K]` (gate rows `[0, N)`, up rows `[N, 2N)`): each K step
loads the gate and the up tile of the item's column block, into two accumulators, so both
halves of a column are in one consumer's registers (as in the bf16 up-proj). Each consumer
TMA-loads its rows' scales and the item's column scales into SMEM at the start of the item,
overlapping the K loop.

fp8 accumulation (`config.fp8_promote_every`): Hopper's fp8 wgmma does not accumulate in
f32. Per k=32 instruction it aligns the accumulator and the 32 products to their largest
exponent and truncates every term toward zero 13 bits below it, then the sum to 13 bits below
its own leading bit (a bit-exact numpy model of this is `tests/fp8_wgmma_model.py`;
docs/quant.md). Left alone over K = 1536, the growing
accumulator costs each later product its low bits (2.3% of the 7B down-proj's outputs off by
more than a bf16 step). So, as DeepSeek-V3 / DeepGEMM do, the K loop runs in intervals of
`fp8_promote_every` K blocks (128 elements each): each interval wgmmas into a fresh zeroed
accumulator, waits for it, and adds it into f32 accumulators carried in registers through the
K loop (CUDA-core adds, exact f32 rounding). A second accumulator set doubles the registers:
`block_n * (2 if gated else 1) <= 128` then (64 for the gated up-proj, 128 for the down-proj).

The gathered mode (`token_ids`): A is [T, K] source rows, and an item's box rows are gathered
by token id. Two specs use it: the fp8 forward's up-proj without smooth scales (A the e4m3
tokens, quantized once each) and the split dH's GEMM (`dh.dh_split`: `dA' = dO[tok] @
W2[e]^T` in bf16 with f32 out, the up-proj's 128-row items with 128-register accumulators and
no epilogue math). In either,
the producer stages the box's ids in SMEM (two buffers: the next item's land while this one
loads) and issues 16-byte cp.async loads from all 128 threads straight into the swizzled
wgmma layout (`_common.cp_async_gather_rows`, as the bf16 up-proj; published the
`gather_completion` way), or one-row TMA copies (`gather="tma"`, what interpret mode runs).
Split M only (not `pingpong`): the lagged cp.async publish walks one `full` barrier set.

Otherwise A is contiguous, so each stage is one `[block_m, block_k]` TMA box. Mosaic's tiled TMA needs
the box's first row to be a multiple of 8, so tiles come from `aligned_tile_meta` (computed
once per plan): a tile is a piece of one expert's rows inside one `block_m`-aligned block,
and its work item loads the whole aligned block. Rows of the box outside the tile (other
experts, padding) are multiplied like the rest and dropped: the epilogue TMA-stores only the
tile's rows (`store_row_tile`), so a tile never writes another expert's rows. The output tile
sits in SMEM as 128-byte-swizzled slabs (`_common.row_tile_types`): the accumulator layout's
register stores are then free of bank conflicts (untiled rows put a warp's 8 rows in one
bank), which made the down-proj 0.81x and dX~ 0.83x of their time on the H100 (session 5).

The kernel is persistent: `num_sms` CTAs of one producer and two consumer warpgroups, items
of `block_m` = 128 rows. Work item w = (tile w // grid_n, column block w % grid_n); CTA s
takes items s, s + num_sms, ... over the real tiles (`aligned_tile_meta` puts them first),
or over one chunk's range of them (`_common.TileChunks`: the chunked EP overlap runs the
down-proj as several calls over the whole A and metadata, each writing its own output).
The producer issues every K step of every item back to back into a `num_stages`-slot ring
(step g uses slot g % num_stages, waits `empty[slot]`, arrives on `full[.., slot]`), so the
next item's loads run during the current item's epilogue.
- split M (the default): both consumers share every item, consumer c multiplying rows
  [64c, 64c + 64) of the A box by the same weight tile, so each weight tile streamed from L2
  feeds 128 rows (~11 KB of SMEM operands per MFLOP instead of ~19 KB); both release each
  slot, and a consumer's epilogue store drains while the next item's wgmmas run. But both
  consumers reach their epilogue together, so the tensor cores idle through it.
- `pingpong` (CUTLASS's ping-pong at 128 rows): the CTA's j-th item goes to consumer j % 2,
  which multiplies all 128 rows of it (a 128 x block_n accumulator, two m64 wgmmas per
  step), so the weight tile still feeds 128 rows and one consumer's epilogue overlaps the
  other's wgmmas; each consumer waits only on its own `full` barriers, so its phase
  tracking stays exact.

With a bias, each consumer TMA-loads its item's `[block_n]` bias columns into its own SMEM
when the item starts (they land while the K loop runs) and adds them to the fp32
accumulator in the epilogue (`_common.bias_columns`). The SMEM is rewritten only after the
previous item's epilogue has read it: the epilogue's `commit_smem` (a warpgroup barrier)
comes between the reads and the next copy.

Removed in session 64, none a default (a config naming a removed field is a TypeError):
- `cluster_m=2` (items on clusters of two CTAs sharing each weight tile by multicast): 0.893x
  / 0.981x the split-M down-proj on the H100 (session 64; 0.84-1.04x, session 50);
  `benchmarks/history/session64/grouped_gemm_clusters.patch` restores it.
- `out_buffers >= 2` (a ring of staged output rounds with `out_slabs`): 1.002x on the H200
  (session 38), 0.997x / 1.005x on the split dH's GEMM on the H100 (session 64);
  `benchmarks/history/session64/grouped_gemm_out_buffers.patch` restores it.
- `block_m` 64 (64-row ping-pong items: 0.667x the 128 x 192 split-M down-proj at gpt-oss's
  widths on the H100, session 49) and 192 (split M with three consumers of 64 rows:
  1.013-1.019x inside the spread at gpt-oss, sessions 50-51; never adopted, its 30B GPU test
  never passed); `benchmarks/history/session64/grouped_gemm_block_m_192_64.patch` restores
  both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels._common import TileChunks, TileMeta
from pallas_moe.quant.reference import QUANTIZED_DTYPES


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Block sizes of the persistent grouped GEMM (down-proj, dX~).

    Attributes:
      block_m: rows per work item: 128 (split M, or ping-pong with `pingpong`), the only
        value since session 64 (module docstring).
      block_n: output columns per work item (multiple of 64, divides N, at most 256).
      block_k: contraction step, one 128-byte swizzle row: 64 for bf16, 128 for the fp8
        mode; must divide K.
      num_stages: SMEM pipeline depth (>= 2).
      num_sms: CTAs of the persistent grid (the SM count: 132 on an H100 SXM).
      fp8_promote_every: fp8 mode only (bf16 wgmma accumulates in f32 and ignores it): add
        the tensor cores' partial sums into f32 registers every this many K blocks (128
        elements each; the module docstring says why); 0 = never (the hardware accumulator
        only, the fastest and least accurate).
      gather: the gathered mode only (`token_ids`): how the producer gathers A's rows,
        "cp_async" (16-byte cp.async loads from all 128 producer threads,
        `_common.cp_async_gather_rows`; compiled kernels, `num_stages >= 3`) or "tma"
        (one-row TMA copies, `_common.gather_rows`). Interpret mode always runs "tma".
      gather_completion: the gathered mode with "cp_async": "wait_group" or "mbarrier"
        (`_common.GATHER_COMPLETIONS`).
      pingpong: the consumers alternate items, each multiplying all 128 rows (`block_n <=
        128`: a 128 x block_n f32 accumulator per consumer), instead of splitting every
        item's rows; one consumer's epilogue then overlaps the other's K loop. Not with fp8
        promotion or the gathered mode.
      approx_math: compiled kernels only: the `gated` (fp8 up-proj) epilogue's SwiGLU takes
        its exp from the hardware's `ex2.approx` (True, default, as `UpProjConfig`) or the
        full-precision `exp`; the other epilogues have no transcendental math.
      out_slabs: 128-byte output column slabs (64 bf16 columns) each consumer stages in SMEM
        at a time; 0 (default) = the whole block_n. Fewer free SMEM for a pipeline stage
        (the gated fp8 up-proj at block_n=128 fits 4 stages only with 1: 229 KB otherwise)
        at the cost of waiting, before each slab after the first, until the previous slab's
        store has read SMEM. Must divide block_n's slab count.
      wgmma_lag: when a consumer releases a K step's slot, 1 (default) or 0 (one more
        stage loading, the tensor cores idle between steps): `_common.consumer_k_loop`.
        Same bits either way (session 51). Opt-in: on the H100 (session 52)
        dX~ 0.961x at 30B (`docs/kernels.md`).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    num_sms: int = 132
    fp8_promote_every: int = 1
    gather: str = "cp_async"
    gather_completion: str = "wait_group"
    pingpong: bool = False
    approx_math: bool = True
    out_slabs: int = 0
    wgmma_lag: int = 1

    def __post_init__(self):
        if self.block_m != 128:
            raise ValueError(
                f"config.block_m={self.block_m} must be 128 (64 and 192 were removed in "
                "session 64: slower or level on the H100)."
            )
        _common.require_wgmma_lag(self)
        if self.pingpong and self.block_n > PINGPONG_MAX_BLOCK_N:
            raise ValueError(
                f"config.pingpong keeps a 128 x block_n f32 accumulator per consumer: "
                f"block_n must be <= {PINGPONG_MAX_BLOCK_N}, got {self.block_n}."
            )
        _common.require_wgmma_blocks(
            self, "output tiles are 128-byte swizzled", block_ks=FP8_BLOCK_K_CHOICES
        )
        if self.num_sms < 1:
            raise ValueError(f"config.num_sms={self.num_sms} must be >= 1.")
        slabs = self.block_n // 64  # of bf16 outputs; f32 outputs have twice as many
        if (not isinstance(self.out_slabs, int) or isinstance(self.out_slabs, bool)
                or self.out_slabs < 0 or (self.out_slabs and slabs % self.out_slabs)):
            raise ValueError(
                f"config.out_slabs={self.out_slabs} must be 0 (the whole block) or divide the "
                f"block's {slabs} output slabs of 64 bf16 columns (block_n={self.block_n})."
            )
        if self.fp8_promote_every < 0:
            raise ValueError(
                f"config.fp8_promote_every={self.fp8_promote_every} must be >= 0 (0 = never)."
            )

    @property
    def num_consumers(self) -> int:
        """Consumer warpgroups of the kernel: 2."""
        return 2

    @property
    def split_m(self) -> bool:
        """Both consumers share every item, 64 rows each (without `pingpong`)."""
        return not self.pingpong

    @property
    def tile_rows(self) -> int:
        """Rows of one metadata tile (`TileMeta.block_m`): an item's `block_m` rows."""
        return self.block_m

    @property
    def gathers_rows(self) -> bool:
        """Whether the gathered mode (`token_ids`) can run this config: 128-row split-M items,
        both consumers sharing each gathered stage."""
        return not self.pingpong


# A ping-pong consumer of 128 rows holds a 128 x block_n f32 accumulator: 128 registers per
# thread at block_n = 128, beside the epilogue's.
PINGPONG_MAX_BLOCK_N = 128


# fp8 promotion keeps a second f32 accumulator set: at most this many accumulator columns per
# consumer (both sets: 128 registers per thread, as one unpromoted 64x256 accumulator).
FP8_PROMOTED_MAX_COLUMNS = 128

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
INT8 = jnp.dtype(jnp.int8)
INT8_MAX_K = 2**31 // 128**2  # K products of int8 magnitude <= 128 stay exact in s32


def promotes(config: "GroupedMatmulConfig", in_dtype) -> bool:
    """Whether the K loop promotes partial sums into f32 registers: e4m3 inputs with
    `fp8_promote_every > 0` only (int8 wgmma sums exactly in s32, bf16 in f32)."""
    return jnp.dtype(in_dtype) == E4M3 and config.fp8_promote_every > 0


FP8_BLOCK_K_CHOICES = (64, 128)  # bf16, fp8: one 128-byte swizzle row either way


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
    row_scales: jax.Array | None = None,
    col_scales: jax.Array | None = None,
    gated: bool = False,
    out_dtype=jnp.bfloat16,
    bias: jax.Array | None = None,
    token_ids: jax.Array | None = None,
    chunks: TileChunks | None = None,
    chunk: int = 0,
) -> jax.Array:
    """`out[r] = A[r] @ W[e(r)]` (or `@ W[e(r)]^T`) over rows grouped by expert.

    Args:
      a: bf16 [P_a, K] rows in grouped order, or e4m3 / int8 (the 8-bit mode). `P_a` may
        exceed `capacity` (a producer may pad to a multiple of block_m, which saves a copy
        here); extra rows are ignored. With `token_ids`: [T, K] source rows (bf16 tokens,
        or quantized ones), gathered by the kernel.
      group_sizes: i32 [E] rows per expert; rows past the sum are padding.
      w: bf16 [E, K, N], or [E, N, K] with `transpose_w`; e4m3 [E, N, K] (or [E, 2N, K]
        with `gated`) of a's dtype in the 8-bit mode.
      transpose_w: read W K-minor (`[E, N, K]`) and multiply by its transpose (required
        in the fp8 mode: 8-bit wgmma takes B only K-major).
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.
      meta: precomputed `aligned_tile_meta(group_sizes, capacity, config.tile_rows)`.
      capacity: the plan's row capacity P (default a.shape[0]).
      out_cols: width of the result (default N); columns past N are not written.
      names: how errors name `a` and `w` (the caller's argument names).
      kernel_name: the kernel's name in profiles.
      row_scales: fp8 mode: f32 [>= P] dequantization scale of each row of `a` (rows past
        P_a, if any, are never read for real rows).
      col_scales: fp8 mode: f32 [E, N] (or [E, 2N] with `gated`) per-expert, per-output-
        channel scale of `w`.
      gated: fp8 mode: W holds gate and up halves; the output is
        `swiglu(gate, up)` with N = w.shape[1] // 2 columns (`_common.swiglu_epilogue`:
        each half rounded to `out_dtype` first, as the bf16 up-proj's H).
      out_dtype: bf16 (default) or f32.
      bias: bf16 mode only: optional bf16 [E, N]: `out[r] += bias[e(r)]` in fp32 before
        rounding.
      token_ids: i32 [P] source row of `a` of each grouped row (`plan.token_ids`; padding
        rows may name any row in range): the gathered mode, where grouped row r multiplies
        `a[token_ids[r]]` (bf16: the split dH's GEMM `dO[tok] @ W2[e]^T`; 8-bit: the fp8
        up-proj, with `row_scales` f32 [T], one scale per row of `a`, gathered here). Needs
        a config without pingpong (module docstring).
      chunks: run only chunk `chunk` of these `TileChunks` of `meta` (which is then
        required): its tiles, read from the whole A, written to a `[chunks.rows, out_cols]`
        output at rows shifted by the chunk's first row (the EP overlap's chunked down-proj).
        Not with `token_ids`.
      chunk: static index of the chunk to run.

    Returns:
      [P, out_cols] in out_dtype, or `[chunks.rows, out_cols]` with `chunks`: row j holds
      grouped row `chunks.bounds[1, chunk] + j`. Padding rows are not written (their
      contents are unspecified).
    """
    a_name, w_name = names
    if a.ndim != 2:
        raise ValueError(f"{a_name} must be 2-D [P, K], got shape {tuple(a.shape)}.")
    if w.ndim != 3:
        raise ValueError(f"{w_name} must be 3-D, got shape {tuple(w.shape)}.")
    eight_bit = a.dtype in QUANTIZED_DTYPES  # the 8-bit mode
    if eight_bit:
        _common.require_dtype(w_name, w, a.dtype)
        if not transpose_w:
            raise ValueError(
                f"the 8-bit mode needs transpose_w=True: 8-bit wgmma takes B only K-major, so "
                f"{w_name} must be [E, N, K]."
            )
        if row_scales is None or col_scales is None:
            raise ValueError(
                "the 8-bit mode (e4m3 or int8 inputs) needs row_scales and col_scales."
            )
        if config.pingpong and promotes(config, a.dtype):
            raise ValueError(
                "config.pingpong holds a 128-row accumulator per consumer, which leaves no "
                "registers for fp8 promotion's second set: pass fp8_promote_every=0 (or "
                "pingpong=False)."
            )
    else:
        _common.require_dtype(a_name, a, jnp.bfloat16)
        _common.require_dtype(w_name, w, jnp.bfloat16)
        if row_scales is not None or col_scales is not None or gated:
            raise ValueError(
                f"row_scales, col_scales and gated belong to the 8-bit mode (e4m3 or int8 "
                f"inputs); {a_name} is {a.dtype}."
            )
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype.name}.")
    a_rows, k_dim = a.shape
    num_experts = w.shape[0]
    w_k, n_dim = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    if gated:
        if n_dim % 2:
            raise ValueError(f"{w_name}.shape[1]={n_dim} must be even (gate and up halves).")
        n_dim //= 2
    k_axis, n_axis = (2, 1) if transpose_w else (1, 2)
    if w_k != k_dim:
        raise ValueError(
            f"{w_name}.shape[{k_axis}]={w_k} must equal {a_name}.shape[1]={k_dim} (the contraction)."
        )
    if a.dtype == INT8 and k_dim > INT8_MAX_K:
        raise ValueError(
            f"{a_name}.shape[1]={k_dim} must be <= {INT8_MAX_K} in the int8 mode: the s32 "
            "accumulator holds K products of up to 128^2 exactly only that far."
        )
    gathered = token_ids is not None
    if gathered:
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D [P], got shape {tuple(token_ids.shape)}.")
        _common.require_dtype("token_ids", token_ids, jnp.int32)
        if not config.gathers_rows:
            raise ValueError(
                "the gathered mode (token_ids) needs split-M items, config.pingpong=False "
                "(both consumers of one CTA share each gathered stage)."
            )
        _common.require_gather_mode(config)
        if capacity is not None and capacity != token_ids.shape[0]:
            raise ValueError(
                f"capacity={capacity} must equal token_ids.shape[0]={token_ids.shape[0]}."
            )
        capacity = token_ids.shape[0]
    capacity = a_rows if capacity is None else capacity
    if capacity > a_rows and not gathered:
        raise ValueError(f"capacity={capacity} exceeds {a_name}.shape[0]={a_rows}.")
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if bk * a.dtype.itemsize != _common.SWIZZLE_BYTES:
        raise ValueError(
            f"config.block_k={bk} must be {_common.SWIZZLE_BYTES // a.dtype.itemsize} for "
            f"{a.dtype} inputs (one 128-byte swizzle row)."
        )
    _common.require_multiple(
        f"{a_name}.shape[1]", k_dim, bk, f"the K loop steps by block_k={bk}"
    )
    _common.require_multiple(
        f"{w_name}.shape[{n_axis}]" + (" // 2" if gated else ""), n_dim, bn,
        f"a work item computes block_n={bn} columns",
    )
    if bias is not None:
        if eight_bit:
            raise ValueError(
                "bias is a bf16-mode option; the 8-bit mode (e4m3 or int8 inputs) takes no bias."
            )
        _common.require_dtype("bias", bias, jnp.bfloat16)
        _common.require_shape("bias", bias, (num_experts, n_dim))
    out_cols = n_dim if out_cols is None else out_cols
    if out_cols < n_dim:
        raise ValueError(f"out_cols={out_cols} must be >= {n_dim}.")
    if chunks is not None and gathered:
        raise ValueError(
            "chunks (a call over a range of the plan's tiles) is not supported with token_ids "
            "(the gathered mode): run it over the whole plan."
        )
    if meta is None:
        if chunks is not None:
            raise ValueError("chunks cut the tiles of a given meta: pass meta too.")
        meta = _common.aligned_tile_meta(group_sizes, capacity, bm)
    if meta.block_m != bm:
        raise ValueError(f"meta.block_m={meta.block_m} must equal config.block_m={bm}.")
    if chunks is None:
        chunks, chunk = _common.whole_tile_chunk(meta, capacity), 0
    if not 0 <= chunk < chunks.num_chunks:
        raise ValueError(f"chunk={chunk} must be in [0, {chunks.num_chunks}) (chunks.num_chunks).")
    # Each item loads its whole aligned block: make `a` (or the gathered rows' ids) a whole
    # number of blocks.
    padded = -(-capacity // bm) * bm
    row_ids = ()
    if gathered:  # padding rows read row 0: multiplied like the rest and never stored
        row_ids = (jnp.pad(token_ids, (0, padded - capacity)),)
    elif a_rows < padded:
        a = jnp.pad(a, ((0, padded - a_rows), (0, 0)))
    scales = ()
    if eight_bit:
        w_cols = w.shape[1]
        _common.require_shape("col_scales", col_scales, (num_experts, w_cols))
        if gathered:
            _common.require_shape("row_scales", row_scales, (a_rows,))
        elif row_scales.ndim != 1 or row_scales.shape[0] < capacity:
            raise ValueError(
                f"row_scales must be [P_a] with P_a >= capacity={capacity}, got "
                f"{tuple(row_scales.shape)}."
            )
        _common.require_dtype("row_scales", row_scales, jnp.float32)
        if gathered:  # the epilogue reads each grouped row's scale: gather the P of them
            row_scales = row_scales[row_ids[0]]
        _common.require_dtype("col_scales", col_scales, jnp.float32)
        if promotes(config, a.dtype) and (gated + 1) * bn > FP8_PROMOTED_MAX_COLUMNS:
            raise ValueError(
                f"config.fp8_promote_every={config.fp8_promote_every} keeps a second f32 "
                f"accumulator set: block_n{' * 2 (gated)' if gated else ''} must be <= "
                f"{FP8_PROMOTED_MAX_COLUMNS}, got block_n={bn} (use block_n="
                f"{FP8_PROMOTED_MAX_COLUMNS // (gated + 1)}, or fp8_promote_every=0)."
            )
        if row_scales.shape[0] < padded:  # each consumer loads whole row blocks too
            row_scales = jnp.pad(row_scales, (0, padded - row_scales.shape[0]))
        scales = (row_scales, col_scales)
    kernel = _kernel(config, k_dim, n_dim, chunks.rows, out_cols, transpose_w, kernel_name,
                     interpret, in_dtype=a.dtype, out_dtype=out_dtype, eight_bit=eight_bit,
                     gated=gated, has_bias=bias is not None, gathered=gathered, chunk=chunk)
    operands = (meta.expert, meta.row_start, meta.num_rows, chunks.bounds, *row_ids, a, w)
    return kernel(*operands, *scales, *(() if bias is None else (bias,)))


def smem_bytes(config: GroupedMatmulConfig, n_dim: int, *, in_dtype, out_dtype,
               gated: bool = False, has_bias: bool = False, gathered: bool = False) -> int:
    """The SMEM one CTA of the grouped GEMM takes, as `_kernel` lays it out: each scratch
    ref rounded up to `_common.SMEM_ALIGNMENT` (where Pallas starts them) plus 8 B per
    barrier. The refs: the A stages [stages, block_m, block_k], the weight stages ([2 if
    gated], stages, block_k, block_n), each consumer's staged output (the whole [rows,
    block_n] tile, or `out_slabs` of its slabs), and the bias columns, scales,
    gathered ids and (compiled cp.async gather on mbarriers) the stage barriers. The output
    width `n_dim` does not change the count (it did for the fused re-quantization, removed
    in session 63).

    A lower bound of what Mosaic GPU counts (it adds nothing for these kernels today), so
    `_kernel` refuses above `_common.SMEM_MAX` only configs Mosaic would refuse too, but
    with a message naming the config (session 51: the since removed 192-row items with 256
    columns and the whole tile staged took 270 KB at 30B's dX~)."""
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    cons = config.num_consumers
    mb = bm // cons if config.split_m else bm  # rows per consumer
    in_size = jnp.dtype(in_dtype).itemsize
    num_b = 2 if gated else 1
    eight_bit = in_size == 1
    refs = [stages * bm * bk * in_size, num_b * stages * bk * bn * in_size]
    barriers = (1 if config.split_m else 2) * stages + stages
    out_size = jnp.dtype(out_dtype).itemsize
    staged_cols = config.out_slabs * _common.SWIZZLE_BYTES // out_size if config.out_slabs else bn
    refs.append(cons * mb * staged_cols * out_size)
    if has_bias:
        refs.append(cons * bn * in_size)
        barriers += cons
    if eight_bit:  # row scales, column scales
        refs += [4 * 2 * mb, 4 * 2 * num_b * bn]
        barriers += 2
    if gathered:  # two items' row ids; compiled cp.async on mbarriers: one per slot
        refs.append(4 * 2 * bm)
        barriers += 2
        if _common.uses_stage_mbarriers(config, interpret=False):
            refs.append(_common.cp_async_stage_barriers(stages).shape[0] * 8)
    align = _common.SMEM_ALIGNMENT
    return sum(-(-r // align) * align for r in refs) + 8 * barriers


def _kernel(config: GroupedMatmulConfig, k_dim, n_dim, out_rows, out_cols, transpose_w,
            kernel_name, interpret, *, in_dtype, out_dtype, eight_bit: bool, gated: bool,
            has_bias: bool = False, gathered: bool = False, chunk: int = 0):
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    smem = smem_bytes(config, n_dim, in_dtype=in_dtype, out_dtype=out_dtype, gated=gated,
                      has_bias=has_bias, gathered=gathered)
    if smem > _common.SMEM_MAX:
        raise ValueError(
            f"config needs {smem} B of SMEM ({stages} stages of [{bm}, {bk}] rows and "
            f"[{bk}, {bn}] weights, and each consumer's staged output), over the "
            f"{_common.SMEM_MAX} B a CTA has: lower config.num_stages, or stage fewer "
            f"output columns at a time (config.out_slabs); got {config}."
        )
    split_m = config.split_m
    cons = config.num_consumers  # consumer warpgroups
    mb = bm // cons if split_m else bm  # rows per consumer
    num_sms = config.num_sms  # persistent CTAs walking the item list
    num_k = k_dim // bk  # K steps per item
    grid_n = n_dim // bn  # items per tile
    dtype = in_dtype
    tf = _common.mma_transforms(dtype)
    num_b = 2 if gated else 1  # weight tiles per K step (gate and up)
    # Output columns each consumer stages in SMEM per store round (`config.out_slabs`).
    slab_cols = _common.SWIZZLE_BYTES // jnp.dtype(out_dtype).itemsize
    staged_cols = config.out_slabs * slab_cols if config.out_slabs else bn
    rounds = bn // staged_cols  # store rounds per item

    promote_every = config.fp8_promote_every if promotes(config, in_dtype) else 0
    # int8 wgmma sums exactly in s32 (no promotion needed); e4m3 and bf16 in f32.
    acc_dtype = jnp.int32 if in_dtype == INT8 else jnp.float32
    interpret_mode = _common.interpret_params(interpret)
    # The gathered mode: interpret mode cannot run cp.async, it runs the TMA row loader.
    cp_async = gathered and config.gather == "cp_async" and interpret_mode is None
    stage_bars = gathered and _common.uses_stage_mbarriers(config, interpret_mode is not None)
    if gathered:
        a_scratch, a_views = _common.row_gather_buffers(
            stages, bm, bk, dtype, interpret_mode is not None
        )
    else:
        a_scratch, a_views = plgpu.SMEM((stages, bm, bk), dtype, transforms=tf), None

    def body(expert_ref, start_ref, rows_ref, bounds_ref, *refs):
        ids_ref, *refs = refs if gathered else (None, *refs)
        a_ref, w_ref, *refs = refs
        if eight_bit:
            (rs_ref, cs_ref, out_ref, a_smem, b_smem, o_bufs, full, empty,
             rs_smem, cs_smem, scale_bar, *gather_scratch) = refs
            bias_ref, bias_scratch = None, ()
        else:
            bias_ref, *refs = refs if has_bias else (None, *refs)
            out_ref, a_smem, b_smem, o_bufs, full, empty, *refs = refs
            bias_scratch, gather_scratch = (refs[:2], refs[2:]) if has_bias else ((), refs)
        o_copy, o_mma = o_views(o_bufs)  # the output tile: its wgmma and (1, w) TMA views
        if gathered:  # ids of the item's box rows (double-buffered), their barriers
            ids_smem, ids_bar, *a_landed = gather_scratch
            a_copy, a_mma = a_views(a_smem)
            if stage_bars:  # a_landed[0]: per-slot mbarriers the cp.async loads complete
                _common.cp_async_stage_barriers_init(a_landed[0])
        else:
            a_copy = a_mma = a_smem
        wg = jax.lax.axis_index("wg")
        sm = jax.lax.axis_index("sm")
        # The fp8 consumers hold up to two 64x128 (or one 64x256) f32 accumulators plus
        # the broadcast scales of the epilogue, a 128-row ping-pong consumer a 128 x
        # block_n one: give them the producer's registers.
        rebalance = eight_bit or mb == 128
        # This call's tiles [first_tile, end_tile) of the whole metadata (`TileChunks`).
        first_tile = bounds_ref[0, chunk]
        total = (bounds_ref[0, chunk + 1] - first_tile) * grid_n  # work items
        out_row0 = bounds_ref[1, chunk]  # grouped row of output row 0
        my_items = jnp.maximum(total - sm + num_sms - 1, 0) // num_sms

        def item(j):
            w = sm + j * num_sms
            return first_tile + w // grid_n, w % grid_n  # (tile, column block)

        def box_of(row0):  # first row of the aligned block holding the tile starting at row0
            return (row0 // bm) * bm

        def box_start(j):
            tile, _ = item(j)
            return box_of(start_ref[tile])

        def load_ids(j):  # gathered mode: item j's box rows' source rows -> SMEM
            plgpu.copy_gmem_to_smem(
                ids_ref.at[pl.ds(box_start(j), bm)], ids_smem.at[j % 2], ids_bar.at[j % 2]
            )

        @pl.when(wg == cons)
        def _producer():
            if rebalance:
                _common.role_registers("producer", cons)
            if gathered:
                @pl.when(my_items > 0)
                def _():
                    load_ids(0)

            def per_item(j, carry):
                tile, ni = item(j)
                box0 = box_start(j)
                w_e = w_ref.at[expert_ref[tile]]
                c = 0 if split_m else j % 2
                if gathered:
                    # The next item's ids land while this item's rows are gathered. The
                    # buffer they overwrite was read by item j - 1's row copies from every
                    # producer warp (thread), which need not have finished when the issuing
                    # thread gets here: a warpgroup barrier first.
                    plgpu.commit_smem()

                    @pl.when(j + 1 < my_items)
                    def _():
                        load_ids(j + 1)

                    plgpu.barrier_wait(ids_bar.at[j % 2])
                    ids = ids_smem.at[j % 2]

                def per_step(step, carry):  # the item's K step
                    g = j * num_k + step
                    slot = g % stages

                    @pl.when(g >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])

                    k0 = step * bk
                    if cp_async:  # [bm, bk] of a[ids], one cp.async group
                        _common.cp_async_gather_rows(
                            a_ref.at[:, pl.ds(k0, bk)], ids, [a_mma.at[slot]], num_rows=bm
                        )
                    elif gathered:  # one-row TMA copies, from the 4 warps in parallel
                        def per_warp(warp):
                            _common.gather_rows(
                                a_ref, ids, [a_copy.at[slot]], full.at[c, slot], col0=k0,
                                width=bk, first_row=warp * (bm // 4), num_rows=bm // 4,
                                unroll=4,
                            )

                        plgpu.warp_map(per_warp)
                    else:
                        plgpu.copy_gmem_to_smem(  # [bm, bk]
                            a_ref.at[pl.ds(box0, bm), pl.ds(k0, bk)], a_smem.at[slot],
                            full.at[c, slot],
                        )
                    for h in range(num_b):  # h = 1: the matching up columns, n_dim later
                        col0 = h * n_dim + ni * bn
                        if transpose_w:  # [bn, bk], K-minor
                            w_tile = w_e.at[pl.ds(col0, bn), pl.ds(k0, bk)]
                        else:  # [bk, bn]
                            w_tile = w_e.at[pl.ds(k0, bk), pl.ds(col0, bn)]
                        plgpu.copy_gmem_to_smem(w_tile, b_smem.at[h, slot], full.at[c, slot])
                    if cp_async:  # after the weight copies: publishing may wait
                        _common.cp_async_publish(g, full.at[0], a_landed, stages)
                    return carry

                jax.lax.fori_loop(0, num_k, per_step, None)
                return carry

            jax.lax.fori_loop(0, my_items, per_item, None)
            num_steps = my_items * num_k
            if cp_async:
                _common.cp_async_publish_rest(num_steps, full.at[0], a_landed, stages)
            # Observe the releases of the last `stages` steps too, so every barrier phase is
            # consumed before exit (interpret mode checks this).

            def drain(g, carry):
                plgpu.barrier_wait(empty.at[g % stages])
                return carry

            jax.lax.fori_loop(jnp.maximum(num_steps - stages, 0), num_steps, drain, None)

        def k_steps(j, k0, length, bar_c, a_rows):
            """The consumer's K steps `[k0, k0 + length)` of item j (`length` static) into
            `num_b` zeroed accumulators; releases each slot once the next step's wgmma is
            issued, the last one after the final wait. Returns num_b [mb, bn] f32."""

            def scope(*accs):
                def wait(g, slot):
                    plgpu.barrier_wait(full.at[bar_c, slot])
                    if stage_bars:
                        _common.cp_async_consumer_wait(g, a_landed, stages)

                def mma(slot):
                    for h, acc in enumerate(accs):
                        b = b_smem.at[h, slot]
                        if transpose_w:
                            b = b.transpose((1, 0))
                        plgpu.wgmma(acc, a_mma.at[slot, a_rows], b)  # [mb,bk] @ [bk,bn]

                _common.consumer_k_loop(length, stages, wait, mma, empty, mmas_per_step=num_b,
                                        step_of=lambda t: j * num_k + k0 + t,
                                        wgmma_lag=config.wgmma_lag)
                plgpu.barrier_arrive(empty.at[(j * num_k + k0 + length - 1) % stages])
                return tuple(acc[...] for acc in accs)

            return pl.run_scoped(scope, *[plgpu.ACC((mb, bn), acc_dtype)] * num_b)

        def promoted_k_loop(j, bar_c, a_rows):
            """The consumer's K loop of item j with fp8 promotion: per interval of
            `promote_every` K blocks, `k_steps` into zeroed accumulators, then an add into
            f32 accumulators carried in registers. Returns num_b [mb, bn] f32."""

            def interval(k0, length, totals):  # K blocks [k0, k0 + length); length static
                partials = k_steps(j, k0, length, bar_c, a_rows)
                return tuple(total + p for total, p in zip(totals, partials))

            zeros = plgpu.layout_cast(jnp.zeros((mb, bn), jnp.float32), plgpu.Layout.WGMMA)
            num_full, tail = divmod(num_k, promote_every)
            totals = jax.lax.fori_loop(
                0, num_full, lambda i, tot: interval(i * promote_every, promote_every, tot),
                (zeros,) * num_b,
            )
            if tail:
                totals = interval(num_full * promote_every, tail, totals)
            return totals

        for c in range(cons):
            @pl.when(wg == c)
            def _consumer(c=c):
                if rebalance:
                    _common.role_registers("consumer", cons)
                bar_c = 0 if split_m else c
                a_rows = pl.ds(c * mb, mb) if split_m else slice(None)

                def per_item(i, carry):
                    j = i if split_m else 2 * i + c
                    tile, ni = item(j)
                    row0 = start_ref[tile]
                    num_rows = rows_ref[tile]
                    box0 = box_of(row0)
                    shift = row0 - box0  # box row of the tile's first row
                    if split_m:
                        # this consumer's box rows [c*mb, c*mb + mb) ∩ the tile's
                        c_lo = c * mb
                        lo = jnp.maximum(shift, c_lo)
                        count = jnp.maximum(jnp.minimum(shift + num_rows, c_lo + mb) - lo, 0)
                        dst0, src0 = box0 + lo, lo - c_lo
                    else:
                        count, dst0, src0 = num_rows, row0, shift
                    if has_bias:  # lands while the K loop runs
                        bias_smem, bias_bars = bias_scratch
                        plgpu.copy_gmem_to_smem(
                            bias_ref.at[expert_ref[tile], pl.ds(ni * bn, bn)], bias_smem.at[c],
                            bias_bars.at[c],
                        )

                    if eight_bit:  # this item's scales -> SMEM, waited on in the epilogue
                        scale_rows = box0 + (c * mb if split_m else 0)
                        plgpu.copy_gmem_to_smem(
                            rs_ref.at[pl.ds(scale_rows, mb)], rs_smem.at[c], scale_bar.at[c]
                        )
                        for h in range(num_b):
                            plgpu.copy_gmem_to_smem(
                                cs_ref.at[expert_ref[tile], pl.ds(h * n_dim + ni * bn, bn)],
                                cs_smem.at[c, h], scale_bar.at[c],
                            )

                    # Named regions: `benchmarks/timeline.py` (no-ops unless profiled).
                    with jax.named_scope("k_loop"):
                        if promote_every:
                            accs = promoted_k_loop(j, bar_c, a_rows)
                        else:
                            accs = k_steps(j, 0, num_k, bar_c, a_rows)  # [mb, bn] f32 each
                    with jax.named_scope("epilogue_math"):
                        if eight_bit:
                            plgpu.barrier_wait(scale_bar.at[c])
                            y = _dequantize_epilogue(accs, rs_smem.at[c], cs_smem.at[c], out_dtype)
                        else:
                            (y,) = accs
                        if has_bias:
                            plgpu.barrier_wait(bias_bars.at[c])
                            y = y + _common.bias_columns(bias_smem.at[c], mb)
                    y = y.astype(out_dtype)
                    for r in range(rounds):  # one round unless `out_slabs`
                        with jax.named_scope("previous_store"):
                            # the staged buffer's previous store has read SMEM
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        with jax.named_scope("epilogue_store"):
                            cols = slice(r * staged_cols, (r + 1) * staged_cols)
                            _common.write_row_tile(o_mma.at[c, 0], y[:, cols])
                            plgpu.commit_smem()
                            _common.store_row_tile(
                                o_copy.at[c, 0],
                                out_ref.at[:, pl.ds(ni * bn + r * staged_cols, staged_cols)],
                                dst0 - out_row0, count, mb, src_row0=src0,
                            )
                    return carry

                num_mine = my_items if split_m else (my_items - c + 1) // 2
                jax.lax.fori_loop(0, num_mine, per_item, None)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    b_shape = (num_b, stages, bn, bk) if transpose_w else (num_b, stages, bk, bn)
    # full[.., slot]: the A box (or what the row gather adds) and the weight tile(s) of one
    # K step.
    a_arrivals = (
        _common.gather_full_arrivals(config, bm, interpret_mode is not None) if gathered else 1
    )
    # per consumer: the output tile (or `out_slabs` of its slabs), swizzled 128-byte slabs
    # (the size-1 axis: one staged buffer, as the up-proj's)
    o_scratch, o_views = _common.row_tile_buffers(
        (cons, 1, mb, staged_cols), out_dtype, interpret_mode is not None
    )
    scratch = [
        a_scratch,
        plgpu.SMEM(b_shape, dtype, transforms=tf),
        o_scratch,
        plgpu.Barrier(
            num_arrivals=a_arrivals + num_b, num_barriers=(1 if split_m else 2, stages)
        ),
        # empty: the slot's consumer (split M: all of them)
        plgpu.Barrier(num_arrivals=cons if split_m else 1, num_barriers=stages),
    ]
    if has_bias:  # per consumer: the item's bias columns and the barrier their copy arrives on
        scratch += [plgpu.SMEM((cons, bn), dtype), plgpu.Barrier(num_barriers=cons)]
    if eight_bit:  # per consumer: its rows' scales, the item's column scales, their barrier
        scratch += [
            plgpu.SMEM((2, mb), jnp.float32),
            plgpu.SMEM((2, num_b, bn), jnp.float32),
            plgpu.Barrier(num_arrivals=1 + num_b, num_barriers=2),
        ]
    if gathered:  # the ids of two items' box rows, their barriers, the cp.async stage barriers
        scratch += [plgpu.SMEM((2, bm), jnp.int32), plgpu.Barrier(num_barriers=2)]
        scratch += [_common.cp_async_stage_barriers(stages)] if stage_bars else []
    return plgpu.kernel(
        body,
        kernel_name=kernel_name,
        out_type=jax.ShapeDtypeStruct((out_rows, out_cols), out_dtype),
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=cons + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=config.approx_math,
        ),
        interpret=interpret_mode,
    )


def _dequantize_epilogue(accs, row_scales_smem, col_scales_smem, out_dtype):
    """fp8 epilogue: `acc * row_scale * col_scale` per accumulator (f32), then SwiGLU of the
    (gate, up) pair when there are two. Returns [mb, bn] f32 (or out_dtype for SwiGLU).

    Args:
      accs: one or two (gate, up) f32 [mb, bn] accumulators in the WGMMA layout.
      row_scales_smem: SMEM f32 [mb], the scales of the consumer's rows.
      col_scales_smem: SMEM f32 [len(accs), bn], the item's column scales.
      out_dtype: the output dtype (SwiGLU rounds each half to it first).
    """
    mb, bn = accs[0].shape
    accs = [acc.astype(jnp.float32) for acc in accs]  # int8 mode: exact s32 sums -> f32
    layout = plgpu.Layout.WGMMA
    rows = plgpu.load(row_scales_smem, layout=layout.reduce(1), optimized=False)  # [mb]
    rows = jax.lax.broadcast_in_dim(rows, (mb, bn), [0])
    out = []
    for h, acc in enumerate(accs):
        cols = plgpu.load(col_scales_smem.at[h], layout=layout.reduce(0), optimized=False)
        out.append(acc * rows * jax.lax.broadcast_in_dim(cols, (mb, bn), [1]))
    if len(out) == 1:
        return out[0]
    act, _, _ = _common.swiglu_epilogue(out[0], out[1], out_dtype)
    return act
