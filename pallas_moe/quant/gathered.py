"""Gathered row-block SmoothQuant (Pallas Mosaic GPU): the token gather, the per-expert
smoothing and the row-wise quantization of `moe_smoothquant`'s grouped rows in one pass.

For grouped row r (token t = token_ids[r], expert e = the group holding r):

    Y = x[t] * S[e]  (f32);   Q[r], s[r] = quantize_row(Y)      (`quant/reference.py`)

and Q = 0, s = 0 on rows past `num_rows`. Same bits as `smoothquant_rows_reference`.

Why. The CSR kernel (`quant.kernel.smoothquant_kernel`) walks tokens and reads one f32
scale row S[e] per output row (`P d 4` bytes, four times what it writes) and reduces each
row across the warpgroup: 0.57 of a device copy at the 7B shape. Here persistent CTAs walk
*blocks of grouped rows*: a block's rows belong to one expert, sometimes two, so each scale
row is loaded once per block, and every row is reduced inside one quad of threads of the
wgmma register layout (no barrier per row), as in the row-block quantizer
(`quant.kernel.quantize_row_blocks`) this kernel generalizes. Measured on the H100 (session
14, docs/quant.md) it is still slower than the CSR kernel (331 vs 227 us at 7B, 895 vs 677
us at 30B: bound by instructions, each element converted and smoothed in both passes), so
`moe_smoothquant` runs it only when given a `GatheredQuantConfig`.

Layout of a block (why "bands"). The math runs on `[64, block_cols]` f32 chunks in the
wgmma register layout (64 register rows). A whole block has to stay in SMEM between the
row maxima and the quantization (a second read from L2 would double the gathered traffic),
and 64 rows of d = 1536 bf16 are 192 KB, 64 rows of d = 7168 are 896 KB: more than the
227 KB of SMEM. So a block holds `R = 64 / parts` real rows and each real row is cut into
`parts` bands of `C = d / parts` columns: register row `k R + i` holds band k (columns
`[k C, (k+1) C)`) of the block's real row i. A row's max is the max of its bands' maxima
(one SMEM round trip per block); each register row is quantized with its real row's scale,
and band k of the quantized tile is stored to columns `[k C, (k+1) C)` of the block's R
output rows. With R >= 16 a warp's 16 register rows lie in one band, so each thread loads
its own band's scale columns (no per-element select). The block lives in SMEM as
`C / block_cols` chunks of `[64, block_cols]` bf16 (128-byte-swizzled 64-column slabs) in
a ring of `num_slots` chunk slots: chunks of the next blocks load as soon as pass 2 of the
current block frees slots (a chunk-granular pipeline; `num_slots >= chunks per block`).
`warpgroups` consumer warpgroups share each block, each with its own contiguous share of
the chunks, its own slots, loads and stores, and one cross-warpgroup barrier per block for
the row maxima.

Loads. Each 128-byte piece of a gathered row goes to its place in a swizzled slab:
`loader="cp_async"` (compiled default): all 128 threads issue 16-byte `cp.async` loads (8
threads per 128-byte piece; rows past `num_rows` are zero-filled without reading), one
cp.async group per chunk; `loader="tma"` (what interpret mode runs, also compiled): one
`[1, 64]` TMA copy per piece, completing on the chunk slot's barrier. With smooth scales
each chunk also loads its columns of the scale rows of the block's first and last expert
(`[2, parts, block_cols]` f32 beside the chunk), so a scale row is read once per block
(1/R of the CSR kernel's scale traffic) and never synchronously. Experts strictly between
the first and the last (only in a block spanning three or more experts, i.e. an expert with
fewer than R rows) read their scale chunks from global memory (rare; correct either way).

Block order (L2 reuse). A token's K rows sit in K different expert groups, far apart in
grouped order. Each expert's rows are ordered by token, so visiting the blocks sorted by
their first row's token (`token_order=True`: one argsort of the block keys per call) makes
the CTAs that run at the same time read rows of nearby tokens in every expert: a token's X
row comes from DRAM about once and from L2 for its other K - 1 rows.

Per-block metadata (the R token ids, first row, real rows, first/last expert and their
segment bounds) is computed in XLA once per call, in processing order, and TMA-loaded into
an SMEM ring a few blocks ahead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.quant.reference import apply_row_scale, qmax_of, row_scale

REGISTER_ROWS = 64  # rows of the wgmma register layout the math runs in
SLAB_COLS = 64  # bf16 columns of one 128-byte swizzled slab (one gathered piece)
PARTS = (1, 2, 4, 8)
LOADERS = ("cp_async", "tma")
# Dynamic SMEM a CTA may take on an H100 (227 KB); the kernel's scratch must fit below it.
SMEM_LIMIT_BYTES = 227 * 1024
_META_EXTRA = 8  # metadata columns after the R token ids (see `_block_metadata`)
_Q_TILES = 2  # quantized [64, block_cols] tiles in flight to TMA stores


@dataclasses.dataclass(frozen=True)
class GatheredQuantConfig:
    """Block sizes of `quantize_gathered_rows`.

    Attributes:
      parts: bands per row (1, 2, 4 or 8): a block holds `64 / parts` real rows, each cut
        into `parts` column bands of `d / parts` (module docstring). None: the fewest
        parts whose block fits in SMEM (`for_width`).
      block_cols: columns of a chunk (a multiple of 128 dividing `d / parts`): the unit of
        the SMEM ring, of a register pass (`[64, block_cols]` f32: block_cols / 2 registers
        per thread) and of a quantized tile.
      warpgroups: consumer warpgroups per CTA (1 to 4), sharing each block: warpgroup w
        owns chunks `[w, w + 1) * chunks / warpgroups` of every block (its own ring of
        slots, its own loads and stores); one cross-warpgroup barrier per block combines the
        row maxima. More warps per SM hide the latency of SMEM loads and barriers that one
        warpgroup (one warp per scheduler) cannot. None: 2 where the chunks divide, else 1.
      num_slots: chunk slots of the SMEM ring, all warpgroups together (a multiple of
        `warpgroups`, at least the chunks of one block, `d / (parts * block_cols)`); None:
        as many as fit in `SMEM_LIMIT_BYTES`.
      loader: "cp_async" (16-byte loads from all threads; compiled only) or "tma" (one TMA
        copy per 128-byte piece). Interpret mode always runs "tma".
      token_order: visit blocks sorted by their first row's token (L2 reuse of the K rows
        of a token); False visits them in grouped order (for measurements).
      num_sms: CTAs of the persistent grid; None = the device's SM count.
    """

    parts: int | None = None
    block_cols: int = 128
    warpgroups: int | None = None
    num_slots: int | None = None
    loader: str = "cp_async"
    token_order: bool = True
    num_sms: int | None = None

    def __post_init__(self):
        if self.parts is not None and self.parts not in PARTS:
            raise ValueError(f"config.parts={self.parts} must be one of {PARTS}.")
        if self.block_cols < 128 or self.block_cols % 128:
            raise ValueError(
                f"config.block_cols={self.block_cols} must be a positive multiple of 128 "
                "(one 128-byte swizzle row of the 8-bit output)."
            )
        if self.warpgroups is not None and self.warpgroups not in MAX_WARPGROUPS_RANGE:
            raise ValueError(
                f"config.warpgroups={self.warpgroups} must be 1 to {MAX_WARPGROUPS_RANGE[-1]}.")
        if self.num_slots is not None and self.num_slots < 1:
            raise ValueError(f"config.num_slots={self.num_slots} must be >= 1.")
        if self.loader not in LOADERS:
            raise ValueError(f"config.loader must be one of {LOADERS}, got {self.loader!r}.")
        if self.num_sms is not None and self.num_sms < 1:
            raise ValueError(f"config.num_sms={self.num_sms} must be >= 1.")

    @classmethod
    def for_width(cls, width: int, *, smoothed: bool = True, in_bytes: int = 2,
                  out_bytes: int = 1, **overrides) -> "GatheredQuantConfig":
        """The default for rows of `width`: the fewest parts whose whole block fits in SMEM
        (measured on the H100, session 14: at d = 4096, 4 parts with no spare slot took
        894 us against 1904 us for 8 parts with spare slots; with parts <= 4 each thread
        loads its own band's scale columns, with 8 every element selects among 8 bands).
        Raises a ValueError naming the width when none fits."""
        base = cls(**overrides)
        if base.parts is not None:
            return base
        for parts in PARTS:
            if width % (parts * base.block_cols):
                continue
            chunks = width // (parts * base.block_cols)
            wgs = _resolve_warpgroups(base.warpgroups, chunks)
            if chunks % wgs:
                continue
            slots = _max_slots(width, parts, base.block_cols, wgs, smoothed, in_bytes, out_bytes)
            if slots >= chunks:
                return dataclasses.replace(base, parts=parts)
        raise ValueError(
            f"d={width}: no parts in {PARTS} gives a block of [64, d / parts] that fits in "
            f"{SMEM_LIMIT_BYTES} bytes of SMEM with columns a multiple of "
            f"block_cols={base.block_cols}."
        )


MAX_WARPGROUPS_RANGE = (1, 2, 3, 4)
DEFAULT_WARPGROUPS = 2


def _resolve_warpgroups(warpgroups: int | None, chunks: int) -> int:
    if warpgroups is not None:
        return warpgroups
    return DEFAULT_WARPGROUPS if chunks % DEFAULT_WARPGROUPS == 0 else 1


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static shape of one kernel instance."""

    width: int  # d
    parts: int  # bands per row
    rows: int  # real rows per block, 64 / parts
    band_cols: int  # C = d / parts
    block_cols: int
    chunks: int  # chunks per block, C / block_cols
    warpgroups: int
    slots: int  # chunk slots of the ring, all warpgroups
    lead: int  # blocks the chunk loads run ahead of the block being quantized
    meta_slots: int  # metadata ring

    @property
    def slabs(self) -> int:  # 64-column slabs per chunk
        return self.block_cols // SLAB_COLS

    @property
    def meta_cols(self) -> int:
        return _meta_cols(self.rows)

    @property
    def wg_chunks(self) -> int:  # chunks of a block each warpgroup owns
        return self.chunks // self.warpgroups

    @property
    def wg_slots(self) -> int:  # ring slots of each warpgroup
        return self.slots // self.warpgroups


def _meta_cols(rows: int) -> int:
    # A TMA copy in Lane semantics moves a multiple of 128 bytes (each thread of the
    # warpgroup arrives with its share of the bytes): 32 i32 columns.
    return -(-(rows + _META_EXTRA) // 32) * 32


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _common.SMEM_ALIGNMENT) * _common.SMEM_ALIGNMENT


def _fixed_smem_bytes(parts: int, block_cols: int, warpgroups: int, out_bytes: int,
                      meta_slots: int) -> int:
    """SMEM besides the chunk ring: quantized tiles, scales, row maxima, metadata ring."""
    rows = REGISTER_ROWS // parts
    return (
        _aligned(warpgroups * _Q_TILES * REGISTER_ROWS * block_cols * out_bytes)
        + _aligned(2 * REGISTER_ROWS * 4)  # s of two blocks
        # each warpgroup's row maxima of two blocks, written twice (band rotations)
        + _aligned(2 * warpgroups * 2 * REGISTER_ROWS * 4)
        + _aligned(meta_slots * _meta_cols(rows) * 4)
        + _common.SMEM_ALIGNMENT  # barriers
    )


def _ring_bytes(slots: int, parts: int, block_cols: int, smoothed: bool, in_bytes: int) -> int:
    x = _aligned(slots * REGISTER_ROWS * block_cols * in_bytes)
    scale = _aligned(slots * 2 * parts * block_cols * 4) if smoothed else 0
    return x + scale


def _lead_and_meta_slots(wg_chunks: int, wg_slots: int) -> tuple[int, int]:
    # Pass 2 of a warpgroup's chunk c of block i issues its chunk (c + wg_slots) % wg_chunks
    # of block i + (c + wg_slots) // wg_chunks: at most `lead` blocks ahead. The metadata
    # of block j is loaded when block j - lead - 1 starts and read until block j ends.
    lead = (wg_chunks - 1 + wg_slots) // wg_chunks
    return lead, lead + 2


def _smem_bytes(width, parts, block_cols, warpgroups, slots, smoothed, in_bytes, out_bytes):
    chunks = width // (parts * block_cols)
    _, meta_slots = _lead_and_meta_slots(chunks // warpgroups, slots // warpgroups)
    return (_ring_bytes(slots, parts, block_cols, smoothed, in_bytes)
            + _fixed_smem_bytes(parts, block_cols, warpgroups, out_bytes, meta_slots))


def _max_slots(width, parts, block_cols, warpgroups, smoothed, in_bytes, out_bytes) -> int:
    """The most ring slots (a multiple of `warpgroups`) that fit in SMEM_LIMIT_BYTES."""
    chunks = width // (parts * block_cols)
    best = 0
    for slots in range(warpgroups, 4 * chunks + 9 * warpgroups, warpgroups):
        if _smem_bytes(width, parts, block_cols, warpgroups, slots, smoothed, in_bytes,
                       out_bytes) <= SMEM_LIMIT_BYTES:
            best = slots
    return best


def gathered_smem_bytes(width: int, config: GatheredQuantConfig, *, smoothed: bool = True,
                        in_bytes: int = 2, out_bytes: int = 1) -> int:
    """SMEM the kernel's scratch takes for rows of `width` under `config` (resolved)."""
    geo = _geometry(width, config, smoothed, in_bytes, out_bytes)
    return _smem_bytes(width, geo.parts, geo.block_cols, geo.warpgroups, geo.slots, smoothed,
                       in_bytes, out_bytes)


def _geometry(width: int, config: GatheredQuantConfig, smoothed: bool, in_bytes: int,
              out_bytes: int) -> _Geometry:
    if config.parts is None:
        config = GatheredQuantConfig.for_width(
            width, smoothed=smoothed, in_bytes=in_bytes, out_bytes=out_bytes,
            **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if f.name != "parts"})
    parts, bc = config.parts, config.block_cols
    _common.require_multiple("d (x.shape[1])", width, parts * bc,
                             f"config.parts={parts} bands of whole config.block_cols={bc} chunks")
    band_cols = width // parts
    chunks = band_cols // bc
    wgs = _resolve_warpgroups(config.warpgroups, chunks)
    _common.require_multiple(
        f"the chunks of a block (d / (parts * block_cols) = {width} / ({parts} * {bc}))",
        chunks, wgs, f"config.warpgroups={wgs} warpgroups own equal shares")
    fit = _max_slots(width, parts, bc, wgs, smoothed, in_bytes, out_bytes)
    slots = config.num_slots if config.num_slots is not None else fit
    _common.require_multiple("config.num_slots", slots, wgs,
                             f"each of the config.warpgroups={wgs} warpgroups has its own slots")
    if slots < chunks:
        raise ValueError(
            f"config.num_slots={slots} must be at least the {chunks} chunks of one block "
            f"(d={width}, parts={parts}, block_cols={bc}): the whole block stays in SMEM "
            "between its row maxima and its quantization."
            + ("" if fit >= chunks else
               f" At most {fit} slots fit in SMEM_LIMIT_BYTES={SMEM_LIMIT_BYTES}: use more parts.")
        )
    need = _smem_bytes(width, parts, bc, wgs, slots, smoothed, in_bytes, out_bytes)
    if need > SMEM_LIMIT_BYTES:
        raise ValueError(
            f"config.num_slots={slots} chunk slots need {need} bytes of SMEM for d={width}, "
            f"parts={parts}, block_cols={bc}, warpgroups={wgs}; at most {SMEM_LIMIT_BYTES} "
            f"fit (num_slots <= {fit})."
        )
    lead, meta_slots = _lead_and_meta_slots(chunks // wgs, slots // wgs)
    return _Geometry(width=width, parts=parts, rows=REGISTER_ROWS // parts,
                     band_cols=band_cols, block_cols=bc, chunks=chunks, warpgroups=wgs,
                     slots=slots, lead=lead, meta_slots=meta_slots)


def gathered_fits(width: int, *, smoothed: bool = True, in_bytes: int = 2,
                  out_bytes: int = 1) -> bool:
    """Whether `GatheredQuantConfig.for_width` finds a block for rows of `width`: some
    `parts` in (1, 2, 4, 8) cuts the row into bands of whole 128-column chunks and the
    whole block fits in SMEM. For bf16 -> 8-bit with smooth scales: every multiple of 128
    up to 1536, and wider widths with enough factors of two (2048, 3072, 4096, 6144, 7168,
    ...), at most 7168."""
    if width % 128:
        return False
    try:
        GatheredQuantConfig.for_width(width, smoothed=smoothed, in_bytes=in_bytes,
                                      out_bytes=out_bytes)
    except ValueError:
        return False
    return True


def _block_metadata(token_ids, group_sizes, num_rows, *, num_tokens: int, rows: int,
                    num_blocks: int, token_order: bool):
    """i32 [num_blocks, `_meta_cols(rows)`], one row per block in processing order:
    `[tok_0 .. tok_{R-1}, r0, live, first, last, first_end, last_start, 0 ...]`.

    tok_i: source token of row r0 + i (clamped into [0, T); 0 past `num_rows`), r0 the
    block's first grouped row, live its real rows (`clip(num_rows - r0, 0, R)`), first /
    last the experts of its first and last real row, first_end the end of the first
    expert's rows and last_start the start of the last expert's, both relative to r0.
    """
    num_experts = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    num_rows = jnp.reshape(num_rows, ()).astype(jnp.int32)
    r0 = jnp.arange(num_blocks, dtype=jnp.int32) * rows
    live = jnp.clip(num_rows - r0, 0, rows)

    def expert_of(r):
        e = jnp.searchsorted(ends, r, side="right")
        return jnp.minimum(e, num_experts - 1).astype(jnp.int32)

    first = expert_of(r0)
    last = expert_of(r0 + jnp.maximum(live, 1) - 1)
    row = r0[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]
    ids = token_ids.astype(jnp.int32)
    tok = ids[jnp.minimum(row, ids.shape[0] - 1)]
    tok = jnp.where(row < num_rows, jnp.clip(tok, 0, num_tokens - 1), 0)
    info = jnp.stack([r0, live, first, last, ends[first] - r0, starts[last] - r0], axis=1)
    pad = jnp.zeros((num_blocks, _meta_cols(rows) - rows - info.shape[1]), jnp.int32)
    meta = jnp.concatenate([tok, info, pad], axis=1)
    if token_order:
        key = jnp.where(live > 0, tok[:, 0], num_tokens)  # padding blocks last
        meta = meta[jnp.argsort(key, stable=True)]
    return meta, starts, ends


def quantize_gathered_rows(
    x: jax.Array,
    smooth_scales: jax.Array | None,
    token_ids: jax.Array,
    group_sizes: jax.Array,
    num_rows: jax.Array,
    *,
    num_out_rows: int,
    out_dtype,
    config: GatheredQuantConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
    """Gather, smooth and row-quantize grouped rows (module docstring):

        Q[r], s[r] = quantize_row(x[token_ids[r]] * S[e(r)])   for r < num_rows
        Q[r], s[r] = 0, 0                                      for num_rows <= r < num_out_rows

    with e(r) the expert whose group (consecutive rows, `group_sizes`) holds row r.

    Args:
      x: [T, d] bf16 or fp16 tokens (d a multiple of `parts * block_cols`).
      smooth_scales: f32 [E, d] per-expert smooth scales, or None (`Y = x`, the bits of a
        row of ones).
      token_ids: integer [P_ids] source token of each grouped row (the plan's); ids are
        clamped into [0, T) (a real row's id outside it is a broken plan:
        `pm.routing.validate_plan` reports it), entries past `num_rows` are never read.
      group_sizes: integer [E] rows per expert.
      num_rows: i32 [] or [1], the real rows (`sum(group_sizes)` for a plan).
      num_out_rows: static P_out >= num_rows, rows of the outputs.
      out_dtype: int8 or float8_e4m3fn.
      config: block sizes; None = `GatheredQuantConfig.for_width(d)`.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams (the
        TMA loader).

    Returns:
      `(q [P_out, d] out_dtype, s f32 [P_out])`.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [T, d], got shape {tuple(x.shape)}.")
    if x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"x must be bf16 or fp16, got {x.dtype}.")
    out_dtype = jnp.dtype(out_dtype)
    qmax_of(out_dtype)  # validates out_dtype
    num_tokens, width = x.shape
    num_experts = group_sizes.shape[0]
    if group_sizes.ndim != 1 or num_experts < 1:
        raise ValueError(
            f"group_sizes must be [E] with E >= 1, got shape {tuple(group_sizes.shape)}.")
    if token_ids.ndim != 1 or token_ids.shape[0] < 1:
        raise ValueError(f"token_ids must be [P] with P >= 1, got shape {tuple(token_ids.shape)}.")
    if not isinstance(num_out_rows, int) or num_out_rows < 1:
        raise ValueError(f"num_out_rows must be a positive int, got {num_out_rows!r}.")
    smoothed = smooth_scales is not None
    if smoothed:
        _common.require_shape("smooth_scales", smooth_scales, (num_experts, width))
        _common.require_dtype("smooth_scales", smooth_scales, jnp.float32)
    config = config or GatheredQuantConfig()
    interpret_mode = _common.interpret_params(interpret)
    geo = _geometry(width, config, smoothed, x.dtype.itemsize, out_dtype.itemsize)
    cp_async = config.loader == "cp_async" and interpret_mode is None
    R, p, C, bc, nc = geo.rows, geo.parts, geo.band_cols, geo.block_cols, geo.chunks
    W, ncw, Kw = geo.warpgroups, geo.wg_chunks, geo.wg_slots
    L, M, ns = geo.lead, geo.meta_slots, geo.slabs
    num_blocks = -(-num_out_rows // R)
    num_ctas = min(config.num_sms or _default_num_sms(), num_blocks)
    meta, starts, ends = _block_metadata(
        token_ids, group_sizes, num_rows, num_tokens=num_tokens, rows=R, num_blocks=num_blocks,
        token_order=config.token_order)
    layout = plgpu.Layout.WGMMA
    row_layout = layout.reduce(1)
    col_layout = layout.reduce(0)
    x_scratch, x_views = _common.row_gather_buffers(geo.slots * ns, REGISTER_ROWS, SLAB_COLS,
                                                    x.dtype, interpret_mode is not None)
    q_scratch, q_views = _common.row_tile_buffers((W * _Q_TILES, REGISTER_ROWS, bc), out_dtype,
                                                  interpret_mode is not None)
    tail_rows = num_out_rows % R  # rows of the last block (0: whole)
    arrivals = REGISTER_ROWS * ns + (2 * p if smoothed else 0)
    # With R >= 16 real rows a warp's 16 register rows lie in one band, so a thread can
    # load its band's scale columns itself (compiled kernels; interpret mode selects).
    per_warp_band = smoothed and 1 < p <= 4 and interpret_mode is None

    def body(meta_ref, x_ref, *refs):
        if smoothed:
            sm_ref, starts_ref, ends_ref, q_ref, s_ref, *scratch = refs
        else:
            q_ref, s_ref, *scratch = refs
            sm_ref = starts_ref = ends_ref = None
        (x_bufs, scale_bufs, q_bufs, s_smem, row_max, meta_smem, meta_bar, max_bar,
         *landed) = scratch
        x_copy, x_mma = x_views(x_bufs)
        q_copy, q_mma = q_views(q_bufs)
        cta = jax.lax.axis_index("sm")
        wg = jax.lax.axis_index("wg") if W > 1 else 0
        count = (num_blocks - cta + num_ctas - 1) // num_ctas  # >= 1: cta < num_blocks

        # Masks are [64] row vectors (two registers per thread) broadcast where they are
        # used: a [64, block_cols] i32 iota would pin block_cols / 2 registers per thread.
        def register_rows():
            return plgpu.broadcasted_iota(jnp.int32, (REGISTER_ROWS,), 0, layout=row_layout)

        def real_rows():  # the block's real row held by each register row
            return register_rows() % R

        def on_rows(pred):  # [64] bool -> [64, bc], constant along each row
            return jax.lax.broadcast_in_dim(pred, (REGISTER_ROWS, bc), [0])

        def load_meta(j):  # by warpgroup 0 for all
            slot = j % M

            @pl.when(wg == 0)
            def _():
                plgpu.copy_gmem_to_smem(meta_ref.at[cta + j * num_ctas], meta_smem.at[slot],
                                        meta_bar.at[slot])

        def meta_of(j, col):
            return meta_smem[j % M, R + col]

        # This warpgroup's chunk cl (static) of a block is the block's chunk wg * ncw + cl;
        # its local step g = i * ncw + cl sits in its ring slot wg * Kw + g % Kw.
        def slot_of(g):
            return wg * Kw + g % Kw

        def col0_of(cl: int):
            return (wg * ncw + cl) * bc

        # ---- chunk loads: this warpgroup's chunk cl of block j into ring slot `slot`
        def issue_chunk(j, cl: int, slot):
            if cl == 0:  # the warpgroup's first chunk of the block: its metadata is needed
                plgpu.barrier_wait(meta_bar.at[j % M])
            mrow = meta_smem.at[j % M]
            if cp_async:
                dsts = [x_mma.at[slot * ns + h] for h in range(ns)]
                _cp_async_chunk(x_ref, sm_ref, mrow, dsts,
                                scale_bufs.at[slot] if smoothed else None,
                                geo=geo, local_chunk=cl)
                return
            col0 = col0_of(cl)
            bar = landed[0].at[slot]

            def row_copy(i, carry):
                tok = mrow[i]
                for k in range(p):
                    for h in range(ns):
                        plgpu.copy_gmem_to_smem(
                            x_ref.at[pl.ds(tok, 1), pl.ds(k * C + col0 + h * SLAB_COLS, SLAB_COLS)],
                            x_copy.at[slot * ns + h, pl.ds(k * R + i, 1)], bar)
                return carry

            jax.lax.fori_loop(0, R, row_copy, None)
            if smoothed:
                for e_slot, col in ((0, 2), (1, 3)):  # first and last expert
                    e = mrow[R + col]
                    for k in range(p):
                        plgpu.copy_gmem_to_smem(sm_ref.at[e, pl.ds(k * C + col0, bc)],
                                                scale_bufs.at[slot, e_slot, k], bar)

        def issue_chunk_if(j, cl: int, slot):
            @pl.when(j < count)
            def _():
                issue_chunk(j, cl, slot)

            if cp_async:  # keep one cp.async group per chunk step, loaded or not
                @pl.when(j >= count)
                def _():
                    _cp_async_commit_empty()

        def wait_chunk(cl: int, slot):
            if cp_async:  # groups newer than this chunk's: the ring's other Kw - 1 - cl
                _cp_async_wait_and_sync(Kw - 1 - cl)
            else:
                plgpu.barrier_wait(landed[0].at[slot])

        # ---- the math
        def x_chunk(slot):
            parts_ = [x_mma[slot * ns + h] for h in range(ns)]
            x = parts_[0] if ns == 1 else jnp.concatenate(parts_, axis=1)
            return x.astype(jnp.float32)

        def band_scale(load_band):
            """[64, bc] f32: band k's scale columns on band k's register rows (p - 1
            selects per element)."""
            scale = jax.lax.broadcast_in_dim(load_band(0), (REGISTER_ROWS, bc), [1])
            for k in range(1, p):
                scale = jnp.where(on_rows(register_rows() // R == k),
                                  jax.lax.broadcast_in_dim(load_band(k), (REGISTER_ROWS, bc), [1]),
                                  scale)
            return scale

        def staged_scale(slot, e_slot):
            if per_warp_band:  # each thread loads its own warp's band: no selects
                vec = _own_band_scale(scale_bufs.at[slot, e_slot], rows=R, layout=col_layout)
                return jax.lax.broadcast_in_dim(vec, (REGISTER_ROWS, bc), [1])
            return band_scale(lambda k: plgpu.load(scale_bufs.at[slot, e_slot, k],
                                                   layout=col_layout, optimized=False))

        def y_chunk(slot, cl: int, blk, masked: bool, zero_past_live: bool):
            """f32 [64, bc]: Y of the warpgroup's chunk cl. Rows past `live` hold whatever
            was loaded (zeros or another token's values) unless `zero_past_live`: pass 1
            masks their maxima instead, pass 2 zeroes them (Q must be +0 there, whatever
            the sign of Y)."""
            y = x_chunk(slot)
            if smoothed:
                y = y * staged_scale(slot, 0)
            if not masked:
                return y
            if smoothed:  # other experts of the block override their rows
                x = x_chunk(slot)
                first, last, r0 = blk["first"], blk["last"], blk["r0"]
                col0 = col0_of(cl)

                def middle(e, y):  # an expert strictly inside the block: from GMEM
                    lo = starts_ref[e] - r0
                    hi = ends_ref[e] - r0
                    scale = band_scale(lambda k: plgpu.load(
                        sm_ref.at[e, pl.ds(k * C + col0, bc)], layout=col_layout,
                        optimized=False))
                    real = real_rows()
                    return jnp.where(on_rows((real >= lo) & (real < hi)), x * scale, y)

                y = jax.lax.fori_loop(first + 1, last, middle, y)

                def last_expert(_, y):
                    return jnp.where(on_rows(real_rows() >= blk["last_start"]),
                                     x * staged_scale(slot, 1), y)

                y = jax.lax.fori_loop(0, (last > first).astype(jnp.int32), last_expert, y)
            if zero_past_live:
                y = jnp.where(on_rows(real_rows() < blk["live"]), y, 0.0)
            return y

        def combine(i, m):
            """Row maxima of the real rows over every warpgroup's chunks and every band, on
            each register row of the row."""
            if W == 1 and p == 1:
                return m
            buf = row_max.at[i % 2]  # two blocks: a fast warpgroup may be one block ahead
            buf[wg, pl.ds(0, REGISTER_ROWS)] = m
            buf[wg, pl.ds(REGISTER_ROWS, REGISTER_ROWS)] = m  # rotations past row 63
            if W == 1:
                plgpu.commit_smem()  # every thread's maxima are in SMEM
            else:  # every warpgroup's maxima (arrive releases, wait acquires)
                plgpu.barrier_arrive(max_bar.at[i % 2])
                plgpu.barrier_wait(max_bar.at[i % 2])
            out = None
            for w in range(W):
                for k in range(p):  # register row r + k R (mod 64): the same real row
                    v = plgpu.load(buf.at[w, pl.ds(k * R, REGISTER_ROWS)], layout=row_layout,
                                   optimized=False)
                    out = v if out is None else jnp.maximum(out, v)
            return out

        def store_q_tile(t, cl: int, blk, tail):
            """TMA-stores quantized tile t (chunk cl, every band) to the block's rows."""
            r0 = blk["r0"]
            col0 = col0_of(cl)
            for k in range(p):
                for h in range(bc // 128):
                    src = q_copy.at[t, h]
                    dst = q_ref.at[:, pl.ds(k * C + col0 + h * 128, 128)]
                    if tail:
                        _store_row_ladder(src, dst, r0, blk["n_out"], R, k * R)
                    else:
                        plgpu.copy_smem_to_gmem(src.at[pl.ds(k * R, R)],
                                                dst.at[pl.ds(r0, R)], commit_group=False)

        def store_scales(i, blk, tail):  # warpgroup 0, with its last chunk's stores
            r0 = blk["r0"]
            if tail:  # a TMA store of fewer than 4 f32 is below its 16-byte granule
                def one(n, carry):
                    s_ref[r0 + n] = s_smem[i % 2, n]
                    return carry

                jax.lax.fori_loop(0, blk["n_out"], one, None)
            else:
                plgpu.copy_smem_to_gmem(s_smem.at[i % 2, pl.ds(0, R)], s_ref.at[pl.ds(r0, R)],
                                        commit_group=False)

        def quantize_block(i, blk, masked: bool, tail: bool):
            amax = None
            for cl in range(ncw):  # pass 1: row maxima, waiting for each chunk
                slot = slot_of(i * ncw + cl)
                wait_chunk(cl, slot)
                m = jnp.max(jnp.abs(y_chunk(slot, cl, blk, masked, False)), axis=1)
                amax = m if amax is None else jnp.maximum(amax, m)
            if masked:  # rows past `live` may hold anything, NaN included: zero rows
                amax = jnp.where(real_rows() < blk["live"], amax, 0.0)
            scale, inv = row_scale(combine(i, amax), out_dtype)
            for cl in range(ncw):  # pass 2: quantize, store, free the chunk's slot
                g = i * ncw + cl
                slot = slot_of(g)
                q = _scale_and_round(y_chunk(slot, cl, blk, masked, True),
                                     jax.lax.broadcast_in_dim(inv, (REGISTER_ROWS, bc), [0]),
                                     out_dtype, exact_clip=interpret_mode is not None)
                t = wg * _Q_TILES + g % _Q_TILES
                # This warpgroup's stores of the tile written _Q_TILES chunks ago (one bulk
                # group per chunk; the newest group is its other tile's) have read it.
                plgpu.wait_smem_to_gmem(_Q_TILES - 1, wait_read_only=True)
                if cl == 0:  # this block's scales; block i - 2's store of them is done
                    @pl.when(wg == 0)
                    def _():
                        s_smem[i % 2] = scale
                _common.write_row_tile(q_mma.at[t], q)
                plgpu.commit_smem()  # the warpgroup is done with the chunk and wrote its Q
                store_q_tile(t, cl, blk, tail)
                if cl == ncw - 1:
                    @pl.when(wg == 0)
                    def _():
                        store_scales(i, blk, tail)
                plgpu.commit_smem_to_gmem_group()
                nxt = cl + Kw  # the chunk this slot holds next
                issue_chunk_if(i + nxt // ncw, nxt % ncw, slot)

        # ---- prologue: metadata of blocks 0..L, this warpgroup's first Kw chunks
        for j in range(L + 1):
            @pl.when(j < count)
            def _(j=j):
                load_meta(j)

        for g in range(Kw):
            issue_chunk_if(jnp.int32(g // ncw), g % ncw, slot_of(g))

        def step(i, carry):
            @pl.when(i + L + 1 < count)
            def _():
                load_meta(i + L + 1)  # its slot held block i - 1's

            r0 = meta_of(i, 0)
            blk = dict(r0=r0, live=meta_of(i, 1), first=meta_of(i, 2), last=meta_of(i, 3),
                       last_start=meta_of(i, 5),
                       n_out=jnp.minimum(R, num_out_rows - r0))
            whole = (blk["live"] == R) & (blk["first"] == blk["last"])
            # (masked, tail) variants of the block's code: every row real and one expert;
            # the rest; the output's last block when num_out_rows is not a multiple of R.
            if tail_rows:
                is_tail = r0 + R > num_out_rows
                variants = (((False, False), whole & ~is_tail), ((True, False), ~whole & ~is_tail),
                            ((True, True), is_tail))
            else:
                variants = (((False, False), whole), ((True, False), ~whole))
            for (masked, tail), cond in variants:
                @pl.when(cond)
                def _(masked=masked, tail=tail):
                    quantize_block(i, blk, masked, tail)

            return carry

        jax.lax.fori_loop(0, count, step, None)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if cp_async:
            _cp_async_wait_and_sync(0)  # nothing may land after the CTA exits

    scratch = [
        x_scratch,
        (plgpu.SMEM((geo.slots, 2, p, bc), jnp.float32) if smoothed
         else plgpu.SMEM((1, 4), jnp.float32)),
        q_scratch,
        plgpu.SMEM((2, REGISTER_ROWS), jnp.float32),
        plgpu.SMEM((2, W, 2 * REGISTER_ROWS), jnp.float32),
        plgpu.SMEM((M, geo.meta_cols), jnp.int32),
        plgpu.Barrier(num_barriers=M),
        plgpu.Barrier(num_arrivals=W, num_barriers=2),
    ]
    if not cp_async:
        scratch.append(plgpu.Barrier(num_arrivals=arrivals, num_barriers=geo.slots))
    kernel = plgpu.kernel(
        body,
        kernel_name="moe_smoothquant_gathered",
        out_type=(
            jax.ShapeDtypeStruct((num_out_rows, width), out_dtype),
            jax.ShapeDtypeStruct((num_out_rows,), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("sm",),
        num_threads=W if W > 1 else None,
        thread_name="wg" if W > 1 else None,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_mode,
    )
    if smoothed:
        return kernel(meta, x, smooth_scales, starts, ends)
    return kernel(meta, x)


def _scale_and_round(y, inv, out_dtype, *, exact_clip: bool):
    """`apply_row_scale(y, inv, out_dtype)` (the reference's `saturate(round(y * inv))`),
    with the clip to [-qmax, qmax] left out where it cannot change a bit (`exact_clip=False`,
    compiled kernels: two fewer instructions per element).

    Why it cannot: inv = rcp(s) with s = fl(amax * fl(1/qmax)) and |y| <= amax, so
    |y * inv| <= qmax * (1 + 2^-21) for a finite row, which rounds to qmax (int8) or to 448
    (e4m3: `cvt.rn.satfinite` saturates what rounds past it); a zero row has inv = 0 and
    y * 0 = +-0 either way; a row with a NaN or infinite scale gives NaN or 0 products,
    which the clip leaves as they are. The GPU's f32 -> s8 / e4m3 conversions saturate."""
    if exact_clip:
        return apply_row_scale(y, inv, out_dtype)
    v = y * inv
    if jnp.dtype(out_dtype) == jnp.int8:
        v = jnp.round(v)  # round half to even
    return v.astype(out_dtype)


def _own_band_scale(scale_ref, *, rows: int, layout):
    """f32 [block_cols] in the wgmma column layout: row `band` of `scale_ref` (SMEM f32
    [parts, block_cols]) where band = (16 * warp) // rows is the band of every register row
    of the calling thread's warp (rows >= 16: a warp holds 16 consecutive register rows).
    Each thread loads from its own band's row, so no per-element select picks the band."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith

    parts, cols = scale_ref.shape
    assert rows >= 16 and rows * parts == REGISTER_ROWS

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((cols,), jnp.float32, layout=layout),
    )
    def _load(ctx, ref):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        warp = arith.remui(arith.divui(utils.thread_idx(), utils.c(32, i32)), utils.c(4, i32))
        band = arith.divui(arith.muli(warp, utils.c(16, i32)), utils.c(rows, i32))
        row = utils.memref_slice(ref, arith.index_cast(ir.IndexType.get(), band))
        return mgpu.FragmentedArray.load_untiled(row, layout=layout.to_mgpu(), optimized=False)

    return _load(scale_ref)


def _store_row_ladder(src, dst, row0, num_rows, max_rows: int, src_row0: int) -> None:
    """`_common.store_rows` without committing a bulk group per copy (the caller commits
    one group per chunk): rows `[src_row0, src_row0 + num_rows)` of a (1, w)-tiled SMEM
    tile to `dst[row0 + i]`, as a sum of power-of-two boxes."""
    start = jnp.int32(0)
    size = 1 << (max_rows.bit_length() - 1)
    while size >= 1:
        this = size

        @pl.when((num_rows & this) != 0)
        def _():
            plgpu.copy_smem_to_gmem(src.at[pl.ds(src_row0 + start, this)],
                                    dst.at[pl.ds(row0 + start, this)], commit_group=False)

        start = start + (num_rows & this)
        size //= 2


# ---- the cp.async loader (compiled kernels; interpret mode runs the TMA copies) ----------

_CP_BYTES = 16
_PIECE_THREADS = _common.SWIZZLE_BYTES // _CP_BYTES  # 8 threads load one 128-byte piece


def _cp_async_chunk(x_ref, sm_ref, meta_row, dsts, scale_dst, *, geo: _Geometry,
                    local_chunk: int):
    """Issues the calling warpgroup's chunk `local_chunk` of a block (the block's chunk
    `wg * wg_chunks + local_chunk`, starting at column col0 of each band) as one cp.async
    group from its 128 threads: register row r's slab h gets
    `x[tok[r % R], (r // R) C + col0 + 64 h :][:64]`
    (zero-filled, nothing read, for rows past the block's real rows), and with smooth
    scales `scale_dst[s, k] = S[expert_s, k C + col0 :][:block_cols]` for the block's first
    (s = 0) and last (s = 1; skipped when it is the first) expert.

    Args:
      x_ref: GMEM [T, d] bf16/fp16. sm_ref: GMEM [E, d] f32 or None.
      meta_row: SMEM i32 [meta_cols], the block's metadata row (`_block_metadata`).
      dsts: SMEM slabs [64, 64] of x's dtype, tiled (8, 64) with the 128-byte swizzle
        (row r at 128 r, its 16-byte piece k at `(k ^ (r % 8)) * 16`; 1024-aligned).
      scale_dst: SMEM f32 [2, parts, block_cols] (untiled) or None.
    """
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm

    R, C, p, bc, d = geo.rows, geo.band_cols, geo.parts, geo.block_cols, geo.width
    itemsize = jnp.dtype(dsts[0].dtype).itemsize
    smoothed = sm_ref is not None
    dst_type = plgpu.RefType(transforms=_common.mma_transforms(dsts[0].dtype))
    arg_types = [plgpu.RefType(), plgpu.RefType(), (dst_type,) * len(dsts)]
    args = [x_ref, meta_row, tuple(dsts)]
    if smoothed:
        arg_types += [plgpu.RefType(), plgpu.RefType()]
        args += [sm_ref, scale_dst]
    rows_per_pass = 128 // _PIECE_THREADS
    scale_pieces = 2 * p * bc * 4 // _CP_BYTES
    pieces_per_row = bc * 4 // _CP_BYTES  # 16-byte pieces of one [block_cols] f32 row

    @plgpu.inline_mgpu(arg_types=tuple(arg_types))
    def _issue(ctx, x, meta, dst_refs, *scale_refs):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        i8 = ir.IntegerType.get_signless(8)
        index = ir.IndexType.get()
        c = lambda v: utils.c(v, i32)  # noqa: E731

        def load_meta(i):
            return memref.load(meta, [arith.index_cast(index, i)])

        def gmem_base(ref):
            return llvm.addrspacecast(llvm.PointerType.get(address_space=1), utils.memref_ptr(ref))

        tid = arith.remui(utils.thread_idx(), c(128))
        # The warpgroup's chunks start at column (wg * wg_chunks + local_chunk) * bc.
        wg = utils.warpgroup_idx(sync=False)
        col0 = arith.muli(arith.addi(arith.muli(wg, c(geo.wg_chunks)), c(local_chunk)), c(bc))
        piece = arith.remui(tid, c(_PIECE_THREADS))
        row_in_pass = arith.divui(tid, c(_PIECE_THREADS))
        live = load_meta(c(R + 1))
        x_base = utils.getelementptr(gmem_base(x), [arith.muli(piece, c(_CP_BYTES))], i8)
        dst_bases = [utils.memref_ptr(r) for r in dst_refs]
        for q in range(REGISTER_ROWS // rows_per_pass):
            r = arith.addi(row_in_pass, c(q * rows_per_pass))
            real = arith.remui(r, c(R))
            band = arith.divui(r, c(R))
            tok = load_meta(real)
            valid = arith.cmpi(arith.CmpIPredicate.slt, real, live)
            size = arith.select(valid, c(_CP_BYTES), c(0))  # zero-fill, no read, past `live`
            col = arith.addi(arith.muli(band, c(C)), col0)
            src_row = utils.getelementptr(
                x_base,
                [arith.addi(arith.muli(arith.extui(i64, tok), utils.c(d * itemsize, i64)),
                            arith.extui(i64, arith.muli(col, c(itemsize))))],
                i8)
            swizzled = arith.xori(piece, arith.andi(r, c(7)))
            dst_off = arith.addi(arith.muli(r, c(_common.SWIZZLE_BYTES)),
                                 arith.muli(swizzled, c(_CP_BYTES)))
            for h, base in enumerate(dst_bases):
                nvvm.cp_async_shared_global(
                    utils.getelementptr(base, [dst_off], i8),
                    utils.getelementptr(src_row, [h * _common.SWIZZLE_BYTES], i8),
                    _CP_BYTES, nvvm.LoadCacheModifierKind.CG, cp_size=size)
        if smoothed:
            sm, sdst = scale_refs
            first = load_meta(c(R + 2))
            last = load_meta(c(R + 3))
            sm_base = gmem_base(sm)
            sdst_base = utils.memref_ptr(sdst)
            for u in range(-(-scale_pieces // 128)):
                pc = arith.addi(tid, c(u * 128))
                e_slot = arith.divui(pc, c(p * pieces_per_row))
                band = arith.remui(arith.divui(pc, c(pieces_per_row)), c(p))
                w = arith.remui(pc, c(pieces_per_row))
                expert = arith.select(arith.cmpi(arith.CmpIPredicate.eq, e_slot, c(0)), first, last)
                wanted = arith.andi(
                    arith.cmpi(arith.CmpIPredicate.ult, pc, c(scale_pieces)),
                    arith.ori(arith.cmpi(arith.CmpIPredicate.eq, e_slot, c(0)),
                              arith.cmpi(arith.CmpIPredicate.ne, last, first)))
                with utils.when(wanted):
                    src_el = arith.addi(arith.muli(expert, c(d)),
                                        arith.addi(arith.muli(band, c(C)), col0))
                    src = utils.getelementptr(
                        sm_base,
                        [arith.addi(arith.muli(arith.extui(i64, src_el), utils.c(4, i64)),
                                    arith.extui(i64, arith.muli(w, c(_CP_BYTES))))],
                        i8)
                    dst = utils.getelementptr(sdst_base, [arith.addi(
                        arith.muli(arith.addi(arith.muli(e_slot, c(p)), band), c(bc * 4)),
                        arith.muli(w, c(_CP_BYTES)))], i8)
                    nvvm.cp_async_shared_global(dst, src, _CP_BYTES,
                                                nvvm.LoadCacheModifierKind.CG)
        nvvm.cp_async_commit_group()

    _issue(*args)


def _cp_async_commit_empty() -> None:
    """An empty cp.async group: keeps one group per chunk step (see `wait_chunk`)."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def _commit(ctx):
        del ctx
        nvvm.cp_async_commit_group()

    _commit()


def _cp_async_wait_and_sync(pending: int) -> None:
    """Waits for this thread's cp.async groups but the newest `pending`, then a warpgroup
    barrier, so every thread's pieces of the chunk are visible to every thread (the reads
    are ordinary SMEM loads: no proxy fence needed)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def _wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)
        mgpu.utils.warpgroup_barrier()

    _wait()


def _default_num_sms() -> int:
    from pallas_moe.kernels.moe_forward import default_num_sms

    return default_num_sms()
