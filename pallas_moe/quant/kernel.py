"""Fused MoE SmoothQuant kernel (Pallas Mosaic GPU): gather, smooth, row-wise quantize.

For every routed (token t, expert e) row written to output row r:

    Y = x[t] * S[e]  (f32);   Q[r], s[r] = quantize_row(Y)   (see `quant/reference.py`)

The kernel walks *tokens*, not output rows: one CTA (one warpgroup) loads `x[t]` from HBM
into registers once (a strided warpgroup layout, `vec` contiguous elements per thread) and
then, for each of the token's rows (CSR: `row_offsets[t]:row_offsets[t+1]`), loads the
expert's smooth-scale row (`E * d * 4` bytes in all, so it stays in L2), reduces `max|Y|`
across the warpgroup, and stores the quantized row and its scale at the row's output
position. So X is read once (`T * d` elements) however many experts a token has, and no
gathered `[P, d]` copy exists: the kernel moves `T*d*sizeof(x) + P*d*sizeof(Q) + 4*P` bytes
plus metadata and the L2-resident scales. Each row's loads take their addresses from loads
issued a row earlier (the expert id with the previous row, then the scale row), so no load
waits on another inside a row; the scale row is not held a row ahead, which leaves
registers for more CTAs per SM (see `SmoothQuantConfig`).

Output rows that no token owns (the plan's padding rows `[num_rows, P)`) are written as
Q = 0, s = 0 by extra CTAs at the end of the grid.

Rows that are already in grouped order (the fp8 forward's A) take the row-block quantizer
below instead (`quantize_row_blocks`): whole 64-row blocks through SMEM, each row reduced
inside one quad of threads of the wgmma register layout, with no barrier per row.

Removed in session 64: `SmoothQuantConfig.int8_rounding="cvt"` (int8 rounded by
`cvt.rni.sat.s8.f32` per element on the quarter-rate conversion pipe: round half to even and
saturate, the same bits for every finite row; never a default), 0.95x / 0.91x of the f32 add
at 7B / 30B (H200, session 26, bitwise: 161.1 against 153.2 us, 633.7 against 577.5; not
measured on the H100);
`benchmarks/history/session64/smoothquant_int8_cvt.patch` restores it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.quant.reference import (
    absmax_scale, apply_row_scale, correctly_rounded_reciprocal, qmax_of, row_scale,
)

_WG = 128  # threads in a warpgroup
# The default's choices of `vec`, best first. 8 (16-byte loads) is taken only when asked:
# at d = 4096 it was 0.94-0.95x of 4 (H200, session 31, same bits); see `docs/quant.md`.
_VECS = (4, 2, 1)
# Rows at least this wide hold X in its own dtype by default (`SmoothQuantConfig.x_per_row`):
# there the f32 row's registers cost a CTA per SM (H100, session 53: 1.02-1.05x at d = 4096
# and 7168; at 1536 the CTAs per SM do not change and it measured 0.98x).
X_PER_ROW_MIN_D = 4096
# SMEM the staged smooth-scale rows may take per CTA (`SmoothQuantConfig.scale_rows_smem`):
# the 227 KB a CTA can have, less room for the row reductions' scratch.
_STAGED_SMEM_BYTES = 220 * 1024
# Rows at least this wide stage 2 smooth-scale rows in SMEM by default (H100, session 54,
# paired, same bits: 1.065x at d = 7168, 1.014x at 4096; 0.985-1.003x at 1536 and 2048).
STAGED_MIN_D, STAGED_ROWS = 4096, 2


@dataclasses.dataclass(frozen=True)
class SmoothQuantConfig:
    """Block sizes of the fused SmoothQuant kernel.

    Attributes:
      block_t: tokens per CTA (walked one after another).
      block_pad: padding rows zeroed per CTA of the padding part of the grid.
      vec: elements each thread loads per access (4 -> 8-byte bf16 loads, 8 -> 16-byte);
        `d` must be a multiple of `128 * vec`. None picks the largest of 4, 2, 1 that
        divides (8 was slower where both fit; `_VECS`).
      x_per_row: with smooth scales, hold the token's X row in x's dtype (`d / 256`
        registers per thread) and widen it to f32 for each of its rows, instead of holding
        the f32 row (`d / 128` registers); the same bits. The widening takes a zero only the
        row knows (OR-ed into the bits), so the compiler cannot hoist it out of the row loop
        and hold the f32 row after all, as it did to session 34's form of this option.
        None (default) picks it where the row is at least `X_PER_ROW_MIN_D` wide. Measured
        on an H100 (session 53, paired, same bits; ncu registers per thread and CTAs per SM
        by registers): d = 7168 150 -> 119 registers, 3 -> 4 CTAs, 1.049x int8 and 1.032x
        e4m3; d = 4096 96 -> 80, 5 -> 6, 1.019x; d = 1536 56 -> 53, 9 CTAs either way,
        0.977x / 0.987x.
      scale_rows_smem: with smooth scales, how many smooth-scale rows are in flight to SMEM
        (TMA bulk copies, one mbarrier per slot; each slot costs `4 * d` bytes of SMEM and no
        registers): row j's copy is issued when row j - scale_rows_smem has read its slot,
        so the L2 round trip of a scale row overlaps the rows before it. 0 loads each row's
        scale row straight into registers in its own iteration, its expert id having come
        with the previous row. None (default) stages `STAGED_ROWS` rows where the row is at
        least `STAGED_MIN_D` wide, else 0. Measured on an H100 (session 54, paired against
        0, same bits): 2 rows 1.065x at d = 7168 and 1.014x at 4096, 0.985-1.003x at 1536
        and 2048; 1 row 0.94-0.97x except at 7168 (1.04x); 3 and 4 rows were slower (at
        7168 their SMEM halves the CTAs per SM).

    Session 63 removed `scale_rows_ahead` (the next 1-3 rows' scale rows held in registers
    ahead, `d / 128` registers per thread each; never a default): 2-3 rows ahead measured
    0.63-0.81x (H200, session 26), 0 rows ahead beat 1 by 1.07-1.09x at d = 2048 and 4096,
    level at 1536 (H200, session 27), and 1 ahead was 0.96x at d = 4096 and 7168 on the
    H100 (session 54), where staged rows (`scale_rows_smem`) now win.
    `benchmarks/history/session63/smoothquant_scale_rows_ahead.patch` restores it.

    Compiled kernels round int8 values by an f32 add of 1.5 * 2^23 on the full-rate FP32 pipe
    (`_saturating_quantize`: round half to even; a finite row needs no saturation). Session
    64 removed `int8_rounding` and its "cvt" (`cvt.rni.sat.s8.f32`; see the module docstring).
    """

    block_t: int = 1
    block_pad: int = 64
    vec: int | None = None
    x_per_row: bool | None = None
    scale_rows_smem: int | None = None

    def __post_init__(self):
        if self.scale_rows_smem is not None and self.scale_rows_smem < 0:
            raise ValueError(
                f"config.scale_rows_smem={self.scale_rows_smem} must be >= 0 (smooth-scale "
                "rows in flight to SMEM; 0 loads them straight into registers)."
            )

    def resolve_x_per_row(self, d: int) -> bool:
        return d >= X_PER_ROW_MIN_D if self.x_per_row is None else self.x_per_row

    def resolve_scale_rows_smem(self, d: int) -> int:
        if self.scale_rows_smem is not None:
            return self.scale_rows_smem
        return STAGED_ROWS if d >= STAGED_MIN_D else 0

    def resolve_vec(self, d: int) -> int:
        if self.vec is not None:
            _common.require_multiple(
                "d (x.shape[1])", d, _WG * self.vec,
                f"each of the {_WG} threads of a warpgroup holds vec={self.vec} elements per access",
            )
            return self.vec
        for vec in _VECS:
            if d % (_WG * vec) == 0:
                return vec
        raise ValueError(
            f"d (x.shape[1])={d} must be a multiple of {_WG} (a warpgroup's {_WG} threads split "
            "each row evenly); use backend='xla' for other widths."
        )


def _rcp_rn(v: jax.Array, layout=None) -> jax.Array:
    """`correctly_rounded_reciprocal` of an f32 array on the GPU: PTX `rcp.rn.f32`, the IEEE
    round-to-nearest-even reciprocal (NaN -> NaN, inf -> 0), which is that function's value
    on every input the kernel gives it (normal scales below 2^126, NaN, inf). One
    instruction sequence per element instead of the remainder-corrected division, which
    Mosaic GPU compiles from `div.full.f32` plus four correction steps. The kernel calls it
    once per row: on a warpgroup splat (`layout` None) or on a smoothed row's reduced [1]
    maximum (`_row_layout(...).reduce(1)`); either holds one register per thread."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm, vector

    layout = plgpu.Layout.WG_SPLAT(v.shape) if layout is None else layout

    @plgpu.inline_mgpu(
        arg_types=(layout,),
        return_type=plgpu.ShapeDtypeStruct(v.shape, jnp.float32, layout=layout),
    )
    def rcp(ctx, values):
        del ctx
        f32 = ir.F32Type.get()

        def one(r):  # a register: an f32, or a vector of them
            if not isinstance(r.type, ir.VectorType):
                return llvm.inline_asm(f32, [r], "rcp.rn.f32 $0, $1;", "=f,f",
                                       has_side_effects=False)
            n = ir.VectorType(r.type).shape[0]
            return vector.from_elements(r.type, [one(vector.extract(r, [], [i])) for i in range(n)])

        # Built register by register: a reduced TILED layout holds plain f32 registers,
        # which `FragmentedArray._pointwise` (vectors only there) does not take.
        registers = np.empty(values.registers.shape, dtype=object)
        for idx in np.ndindex(values.registers.shape):
            registers[idx] = one(values.registers[idx])
        return mgpu.FragmentedArray(_registers=registers, _layout=values.layout, _is_signed=None)

    return rcp(v)


def _row_layout(vec: int):
    """The layout of a smoothed row as a [1, d] array: split over the warpgroup as
    WG_STRIDED splits a [d] row (thread i holds `vec` contiguous elements every `128 * vec`),
    but a TILED layout (loads, row reduction and plain stores in Lane semantics): with the
    scale row loaded in its own iteration, 1.08-1.10x at d = 2048 and 4096 on an H200 over
    the same loop on WG_STRIDED rows, which gained nothing from it (session 27,
    `benchmarks/RESULTS.md`)."""
    from jax.experimental.mosaic.gpu.fragmented_array import Tiling

    return plgpu.Layout.TILED(Tiling(((1, _WG * vec), (32 * vec,), (vec,))),
                              warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)


def _store_gmem(ref, value, layout, interpret: bool) -> None:
    """`ref[...] = value` for a `_row_layout` array (or its reduction) in GMEM: Pallas's
    store takes TILED layouts down the SMEM-only optimized path, so compiled kernels store
    through Mosaic GPU's plain vector stores (interpret mode has no layouts)."""
    if interpret:
        ref[...] = value
        return

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()))
    def store(ctx, v, r):
        del ctx
        v.store_untiled(r, optimized=False)

    store(value, ref)


# int8 rounding by an f32 add: 1.5 * 2^23, whose ulp is 1, so
# `add.rn.f32 v, 0f4B400000` rounds v half to even to an integer held in the low mantissa
# bits, as two's complement in the low byte. `.rn` keeps ptxas from fusing the add with the
# multiply `y * rcp(s)` before it into an fma (which would round the exact product instead).
_INT8_ROUND_ASM = "{ .reg .f32 t; add.rn.f32 t, $1, 0f4B400000; mov.b32 $0, t; }"


def _saturating_quantize(v: jax.Array, out_dtype, layout) -> jax.Array:
    """`apply_row_scale`'s `saturate(round(v))` on the GPU, in fewer instructions, for the
    values `v = y * rcp(s)` of a finite row (|v| <= qmax within a few ulp):
      e4m3: the cast alone (`cvt.rn.satfinite.e4m3x2.f32` rounds half to even and clips to
        +-448 itself, as the clip would; NaN stays NaN);
      int8: an f32 add of 1.5 * 2^23 (`_INT8_ROUND_ASM`, the full-rate FP32 pipe instead
        of the conversion pipe's `cvt.rni.sat.s8.f32`, removed in session 64) and the low
        byte of its bits: round half to even, the integer the clip to +-127 and conversion
        give, since |v| < 127.5 needs no saturation (never -128). Rows whose scale is NaN or
        infinite have meaningless Q (`quant/reference.py`); NaN gives -1 there, not 0.
    Interpret mode runs `apply_row_scale` itself.

    Args:
      v: f32 [d] in `layout` (a WG_STRIDED layout).
      out_dtype: int8 or float8_e4m3fn.
      layout: v's layout.

    Returns:
      [d] out_dtype.
    """
    if jnp.dtype(out_dtype) != jnp.dtype(jnp.int8):
        return v.astype(out_dtype)
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector

    @plgpu.inline_mgpu(
        arg_types=(layout,),
        return_type=plgpu.ShapeDtypeStruct(v.shape, jnp.int8, layout=layout),
    )
    def to_int8(ctx, values):
        del ctx
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)

        def convert(reg):
            n = ir.VectorType(reg.type).shape[0]
            out = [
                arith.trunci(i8, llvm.inline_asm(
                    i32, [vector.extract(reg, [], [i])], _INT8_ROUND_ASM, "=r,f",
                    has_side_effects=False))
                for i in range(n)
            ]
            return vector.from_elements(ir.VectorType.get((n,), i8), out)

        return values._pointwise(convert, output_is_signed=True)

    return to_int8(v)


def supports_width(d: int) -> bool:
    """Whether the kernel takes rows of width `d`."""
    return d % _WG == 0


def smoothquant_kernel(
    x: jax.Array,
    smooth_scales: jax.Array | None,
    row_offsets: jax.Array,
    out_rows: jax.Array,
    row_experts: jax.Array,
    num_rows: jax.Array | None,
    *,
    num_out_rows: int,
    out_dtype,
    config: SmoothQuantConfig = SmoothQuantConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
    """Runs the fused gather + smooth + quantize over a token-major (CSR) row list.

    Each CTA walks `config.block_t` tokens. A token's X row is read once and every CSR entry
    of it quantized from it; the next token's row and CSR bounds are loaded before this
    token's rows are processed, so their latency hides behind this token's work (the kernel
    is latency-bound: one warpgroup per CTA, a few KB per row).

    Args:
      x: [T, d] bf16 or fp16.
      smooth_scales: f32 [E, d], or None for no smoothing (`Y = x`: the same bits as a
        row of ones, without loading it; then every CSR entry of a token gets the same Q
        and s, computed once).
      row_offsets: i32 [T + 1]; token t's rows are CSR entries `[row_offsets[t], row_offsets[t+1])`.
      out_rows: i32 [R]; output row of each CSR entry (a permutation of `[0, num_rows)`
        over the first `row_offsets[T]` entries).
      row_experts: i32 [R]; expert of each CSR entry, in `[0, E)` (the caller clamps;
        unused without smooth scales).
      num_rows: i32 [1], the first padding row: rows `[num_rows, num_out_rows)` are written as
        zeros. None when every output row belongs to a token (no padding CTAs are launched).
      num_out_rows: static P, rows of the outputs.
      out_dtype: int8 or float8_e4m3fn.
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.

    Returns:
      `(q [P, d] out_dtype, s f32 [P])`.
    """
    num_tokens, d = x.shape
    out_dtype = jnp.dtype(out_dtype)
    qmax_of(out_dtype)  # validates out_dtype
    smoothed = smooth_scales is not None
    if smoothed:
        _common.require_shape("smooth_scales", smooth_scales, (smooth_scales.shape[0], d))
    _common.require_shape("row_offsets", row_offsets, (num_tokens + 1,))
    _common.require_shape("row_experts", row_experts, out_rows.shape)
    bt, bp = config.block_t, config.block_pad
    if bt < 1 or bp < 1:
        raise ValueError(f"config.block_t={bt} and config.block_pad={bp} must be >= 1.")
    vec = config.resolve_vec(d)
    x_per_row = config.resolve_x_per_row(d)
    slots = config.resolve_scale_rows_smem(d) if smoothed else 0
    staged = slots > 0
    if slots * d * 4 > _STAGED_SMEM_BYTES:
        raise ValueError(
            f"config.scale_rows_smem={slots} rows of d={d} f32 smooth scales take "
            f"{slots * d * 4} bytes of SMEM, over the {_STAGED_SMEM_BYTES} a CTA may stage."
        )
    layout = plgpu.Layout.WG_STRIDED((d,), vec_size=vec)
    row_layout = _row_layout(vec)  # [1, d]: a smoothed row
    # Interpret mode cannot run inline PTX; the jnp reciprocal gives the same bits.
    reciprocal = correctly_rounded_reciprocal if interpret else _rcp_rn
    token_ctas = pl.cdiv(num_tokens, bt)
    pad_ctas = 0 if num_rows is None else pl.cdiv(num_out_rows, bp)
    num_entries = out_rows.shape[0]
    if num_entries < 1:
        raise ValueError("out_rows must hold at least one CSR entry (pad it; entries past "
                         "row_offsets[T] are never read).")

    def body(*refs):
        refs = list(refs)
        off_ref, rows_ref, exp_ref = refs[:3]
        nr_ref = None if num_rows is None else refs[3]
        x_ref, *rest = refs[3 if num_rows is None else 4:]
        stage_ref = bars_ref = None
        if staged:  # the scratch: [slots, 1, d] f32 scale rows and their barriers
            *rest, stage_ref, bars_ref = rest
        sm_ref, q_ref, s_ref = rest if smoothed else (None, *rest)
        cta = jax.lax.axis_index("cta")

        def load_token(t):
            """X row, CSR bounds and first output row of token t: the row ([1, d] in
            `row_layout` with smooth scales, else [d]) and three i32 scalars (the row index
            clamped for a token without rows past the last entry)."""
            start = off_ref[t]
            first_row = start if smoothed else rows_ref[jnp.minimum(start, num_entries - 1)]
            if smoothed:  # [1, d]
                xt = plgpu.load(x_ref.at[pl.ds(t, 1)], layout=row_layout, optimized=False)
            else:
                xt = plgpu.load(x_ref.at[t], layout=layout)
            return xt, start, off_ref[t + 1], first_row

        def store_at(r, q, s):
            q_ref[r] = q
            s_ref[r] = s

        def scaled(y, inv, y_layout):
            """`apply_row_scale(y, inv)`: Q of a row from its reciprocal scale (broadcast to
            y's shape), the compiled kernel's way on the GPU."""
            if interpret:
                return apply_row_scale(y, inv, out_dtype)
            return _saturating_quantize(y * inv, out_dtype, y_layout)

        def quantize(y):
            """`quantize_row(y)`: one warpgroup reduction for the row's max, then the scale
            and its reciprocal on a splat of it (one register per thread: Mosaic GPU cannot
            bitcast a scalar, which the jnp reciprocal does), so every thread has the
            reciprocal with no second reduction."""
            amax = jnp.max(jnp.abs(y))
            scale, _ = absmax_scale(amax, out_dtype)  # the f32 scalar stored as s
            _, inv = row_scale(jnp.full(y.shape, amax, jnp.float32), out_dtype, reciprocal)
            return scaled(y, inv, layout), scale

        def smoothed_rows(xt, start, stop):
            """Rows [start, stop) of one token from its [1, d] X row (`row_layout`)."""
            # The token's row, converted to f32 once and held across its rows, or held in x's
            # dtype and widened per row (`config.x_per_row`). Session 34's per-row widening
            # was hoisted back out of the loop (the same 56 registers per thread at 7B, ncu
            # on an H200); here it depends on the row (`widened`).
            held = xt if x_per_row else xt.astype(jnp.float32)
            last = stop - 1
            reduced = row_layout.reduce(1)  # [1]: the row's max, scale, reciprocal

            def rcp(v):
                return reciprocal(v) if interpret else _rcp_rn(v, reduced)

            def expert(j):  # the expert of CSR entry j (the last entry's past the end)
                return exp_ref[jnp.minimum(j, last)]

            def smooth_row(e):  # [1, d]
                return plgpu.load(sm_ref.at[pl.ds(e, 1)], layout=row_layout, optimized=False)

            def widened(out_row):
                """The held row as f32. With `x_per_row`, its bits are OR-ed with a zero
                made from the output row (never negative, which the compiler cannot know)
                before widening, so the widening stays inside the loop."""
                if not x_per_row:
                    return held
                salt = jnp.minimum(out_row, 0).astype(jnp.int16)
                bits = jax.lax.bitcast_convert_type(held, jnp.int16) | salt
                return jax.lax.bitcast_convert_type(bits, held.dtype).astype(jnp.float32)

            def quantize_and_store(y, out_row):
                """Q and s of a smoothed [1, d] row, stored at `out_row`."""
                amax = jnp.max(jnp.abs(y), axis=1)  # [1]: one warpgroup reduction
                scale, inv = row_scale(amax, out_dtype, rcp)
                inv = plgpu.layout_cast(jax.lax.broadcast_in_dim(inv, y.shape, (0,)), row_layout)
                q = scaled(y, inv, row_layout)
                _store_gmem(q_ref.at[pl.ds(out_row, 1)], q, row_layout, interpret)
                _store_gmem(s_ref.at[pl.ds(out_row, 1)], scale, reduced, interpret)

            def staged_row(j, out_row):
                """Row j with its scale row from SMEM slot j % slots (`scale_rows_smem`);
                then, once every thread has read the slot, row j + slots's copy into it."""
                slot = j % slots
                later = rows_ref[jnp.minimum(j + 1, last)]
                plgpu.barrier_wait(bars_ref.at[slot])
                smooth = plgpu.load(stage_ref.at[slot], layout=row_layout, optimized=False)
                y = widened(out_row) * smooth  # [1, d]
                # Orders every thread's read of the slot before the copy that refills it.
                plgpu.commit_smem()
                stage_copy(j + slots)
                quantize_and_store(y, out_row)
                return later

            def stage_copy(j):  # entry j's scale row into slot j % slots, if j is a row
                @pl.when(j < stop)
                def _():
                    slot = j % slots
                    # Expert ids are in [0, E) (the caller clamps), so the row is in
                    # bounds: a plain bulk copy of 4 * d contiguous bytes, which no 256-wide
                    # TMA box limits.
                    plgpu.copy_gmem_to_smem(sm_ref.at[pl.ds(exp_ref[j], 1)],
                                            stage_ref.at[slot], bars_ref.at[slot],
                                            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

            if staged:
                for i in range(slots):
                    stage_copy(start + i)
                jax.lax.fori_loop(start, stop, staged_row, rows_ref[start])
                return

            def row(j, carry):
                # Each load's address was loaded a row earlier, so no load waits on another
                # within a row: this row's scale row (its expert id came with the previous
                # row), the next row's expert id and output row, all issued before this
                # row's reduction. (Session 29, H200: asking L1 for the scale row after this
                # one as well, `prefetch.global.L1`, was 0.83-0.86x at every width, same
                # bits.)
                this_expert, out_row = carry
                smooth = smooth_row(this_expert)
                later = (expert(j + 1), rows_ref[jnp.minimum(j + 1, last)])
                y = widened(out_row) * smooth  # [1, d]
                quantize_and_store(y, out_row)
                return later

            jax.lax.fori_loop(start, stop, row, (expert(start), rows_ref[start]))

        def plain_rows(xt, start, stop, first_row):
            q, s = quantize(xt.astype(jnp.float32))
            store_at(first_row, q, s)  # prefetched with the token: most tokens own one row

            def other_row(j, out_row):  # the next output row loaded before this store
                later = rows_ref[jnp.minimum(j + 1, stop - 1)]
                store_at(out_row, q, s)
                return later

            jax.lax.fori_loop(start + 1, stop, other_row,
                              rows_ref[jnp.minimum(start + 1, stop - 1)])

        @pl.when(cta < token_ctas)
        def _tokens():
            first = cta * bt
            count = jnp.minimum(bt, num_tokens - first)

            def process(xt, start, stop, first_row):
                @pl.when(stop > start)
                def _():
                    if smoothed:
                        smoothed_rows(xt, start, stop)
                    else:
                        plain_rows(xt, start, stop, first_row)

            if bt == 1:  # one token per CTA: nothing to prefetch (it would load a row twice)
                process(*load_token(first))
                return

            def token(i, cur):
                nxt = load_token(jnp.minimum(first + i + 1, num_tokens - 1))
                process(*cur)
                return nxt

            jax.lax.fori_loop(0, count, token, load_token(first))

        if nr_ref is not None:

            @pl.when(cta >= token_ctas)
            def _padding():
                first = nr_ref[0]
                zeros = plgpu.layout_cast(jnp.zeros((d,), jnp.float32), layout).astype(out_dtype)
                row0 = (cta - token_ctas) * bp
                start = jnp.clip(first, row0, row0 + bp)
                stop = jnp.minimum(row0 + bp, num_out_rows)

                def zero_row(r, carry):
                    q_ref[r] = zeros
                    s_ref[r] = jnp.float32(0.0)
                    return carry

                jax.lax.fori_loop(start, stop, zero_row, None)

    kernel = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((num_out_rows, d), out_dtype),
            jax.ShapeDtypeStruct((num_out_rows,), jnp.float32),
        ),
        grid=(token_ctas + pad_ctas,),
        grid_names=("cta",),
        kernel_name="moe_smoothquant_csr",
        scratch_types=(
            [plgpu.SMEM((slots, 1, d), jnp.float32), plgpu.Barrier(num_barriers=slots)]
            if staged else []
        ),
        interpret=_common.interpret_params(interpret),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            # Pallas would put a warpgroup barrier before and after every store to a ref
            # (Q and s: up to four per row). They only order memory that one thread both
            # reads and writes; this kernel reads only its inputs and writes only its
            # outputs, and the reductions' SMEM scratch has barriers of its own (as do the
            # staged scale rows: an mbarrier per slot, and a fence and barrier per refill).
            unsafe_no_auto_barriers=True,
        ),
    )
    args = [row_offsets.astype(jnp.int32), out_rows.astype(jnp.int32), row_experts.astype(jnp.int32)]
    if num_rows is not None:
        args.append(jnp.reshape(num_rows, (1,)).astype(jnp.int32))
    args.append(x)
    if smoothed:
        args.append(smooth_scales.astype(jnp.float32))
    return kernel(*args)


def quantize_tokens_kernel(
    x: jax.Array,
    *,
    out_dtype=jnp.float8_e4m3fn,
    config: SmoothQuantConfig = SmoothQuantConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
    """Per-token row quantization of `x` (no smoothing): `Q[t], s[t] = quantize_row(x[t])`.

    The fp8 forward's up-proj input when there are no smooth scales: each token is quantized
    once (T rows, not the plan's P = T*K) and the fp8 GEMM gathers the quantized rows. It is
    `smoothquant_kernel` with one CSR entry per token (its own output row) and no smooth
    scales (`Y = x`: the bits a row of ones gives, `x * 1` being exact, so this is the
    formula of every other path).

    Args:
      x: [T, d] bf16 or fp16.
      out_dtype: int8 or float8_e4m3fn.
      config: the SmoothQuant kernel's block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.

    Returns:
      `(q [T, d] out_dtype, s f32 [T])`.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [T, d], got shape {tuple(x.shape)}.")
    num_tokens, d = x.shape
    tokens = jnp.arange(num_tokens + 1, dtype=jnp.int32)
    return smoothquant_kernel(
        x, None, tokens, tokens[:-1], jnp.zeros((num_tokens,), jnp.int32),
        None, num_out_rows=num_tokens, out_dtype=out_dtype, config=config, interpret=interpret,
    )


# --- Contiguous grouped rows: the row-block quantizer ---------------------------------------

ROW_BLOCK = 64  # rows per block: the height of the wgmma register layout the math runs in
# SMEM the pipeline may take: inputs and outputs of `num_stages` blocks in flight.
_ROW_BLOCK_SMEM_BYTES = 200 * 1024


@dataclasses.dataclass(frozen=True)
class RowBlockQuantConfig:
    """Block sizes of `quantize_row_blocks`.

    Attributes:
      block_cols: columns each register pass holds (a multiple of 128 dividing the row
        width): a [64, block_cols] f32 chunk is block_cols / 2 registers per thread.
      num_stages: row blocks in flight per CTA (the pipeline's SMEM slots); None = as many
        as fit in ~200 KB, at most 4.
      num_sms: CTAs of the persistent grid; None = the device's SM count (132 on an H100).
    """

    block_cols: int = 128
    num_stages: int | None = None
    num_sms: int | None = None

    def __post_init__(self):
        if self.block_cols < 128 or self.block_cols % 128:
            raise ValueError(
                f"config.block_cols={self.block_cols} must be a positive multiple of 128 "
                "(one 128-byte swizzle row of the 8-bit output)."
            )
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"config.num_stages={self.num_stages} must be >= 1.")
        if self.num_sms is not None and self.num_sms < 1:
            raise ValueError(f"config.num_sms={self.num_sms} must be >= 1.")

    def resolve_stages(self, width: int, in_bytes: int, out_bytes: int) -> int:
        if self.num_stages is not None:
            return self.num_stages
        per_block = _row_block_bytes(width, in_bytes, out_bytes)
        return max(1, min(4, _ROW_BLOCK_SMEM_BYTES // per_block))


def _row_block_bytes(width: int, in_bytes: int, out_bytes: int) -> int:
    """SMEM of one block in flight: its input rows, its quantized rows and their scales."""
    return ROW_BLOCK * width * (in_bytes + out_bytes) + ROW_BLOCK * 4


def row_blocks_fit(width: int, in_bytes: int = 2, out_bytes: int = 1) -> bool:
    """Whether `quantize_row_blocks` takes rows of `width` elements: a multiple of 128 whose
    64-row block (input and output) fits the SMEM budget (up to 1024 bf16 -> 8-bit)."""
    return width % 128 == 0 and _row_block_bytes(width, in_bytes, out_bytes) <= _ROW_BLOCK_SMEM_BYTES


def quantize_row_blocks(
    a: jax.Array,
    smooth_scales: jax.Array | None,
    group_sizes: jax.Array,
    num_rows: jax.Array,
    *,
    num_out_rows: int,
    out_dtype,
    config: RowBlockQuantConfig = RowBlockQuantConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array]:
    """Row-wise quantization of rows that are already in grouped order (no gather).

        Q[r], s[r] = quantize_row(a[r] * S[e(r)])   for r < num_rows
        Q[r], s[r] = 0, 0                           for num_rows <= r < num_out_rows

    with `e(r)` the expert owning row r (the plan's groups are consecutive row ranges). The
    fp8 forward re-quantizes the up-proj's output A this way before the down-proj.

    How (why it is faster than walking rows one by one, `smoothquant_kernel`): a persistent
    CTA (one warpgroup) pipelines whole `[64, w]` row blocks through SMEM with TMA (a ring
    of `num_stages` slots written out here: `plgpu.emit_pipeline`'s predicated output
    stores do not run in interpret mode), reads them in the wgmma register layout, where each row lives
    in one quad of threads, so a row's max is a reduction inside each thread and across its
    quad (two shuffles), with no barrier per row; Q goes back through 128-byte-swizzled
    SMEM tiles and TMA, s as a [64] box. Each block makes two passes over its SMEM copy in
    `block_cols` chunks (the row maxima, then the scaled values), so a wide row never sits
    in registers whole. With smooth scales, the block's experts are found once per block
    (a binary search over the group ends) and each expert's scale chunk is loaded per
    (block, chunk, pass) and applied to that expert's rows of the block (`jnp.where`, so a
    non-finite value in a padding row never reaches a real one).

    Args:
      a: [P_a, w] bf16 or fp16 rows in grouped order (w a multiple of `block_cols`); rows
        at or past `num_rows` are never used (their contents may be anything).
      smooth_scales: f32 [E, w] per-expert smooth scales, or None (`Y = a`, the bits of a
        row of ones).
      group_sizes: i32 [E] rows per expert (the plan's); only read with smooth scales.
      num_rows: i32 [] or [1], the plan's real rows (`P_a >= num_rows`).
      num_out_rows: static P_out >= num_rows, rows of the outputs (a multiple of 64).
      out_dtype: int8 or float8_e4m3fn.
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.

    Returns:
      `(q [P_out, w] out_dtype, s f32 [P_out])`.
    """
    if a.ndim != 2:
        raise ValueError(f"a must be [P, w], got shape {tuple(a.shape)}.")
    if a.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"a must be bf16 or fp16, got {a.dtype}.")
    out_dtype = jnp.dtype(out_dtype)
    qmax_of(out_dtype)  # validates out_dtype
    a_rows, width = a.shape
    if not row_blocks_fit(width, a.dtype.itemsize, out_dtype.itemsize):
        raise ValueError(
            f"a.shape[1]={width} must be a multiple of 128 whose 64-row blocks fit in SMEM "
            f"(<= {_ROW_BLOCK_SMEM_BYTES} bytes for input and output); quantize wider rows "
            "with smoothquant_kernel."
        )
    bc = config.block_cols
    _common.require_multiple("a.shape[1]", width, bc, f"config.block_cols={bc} columns per pass")
    _common.require_multiple("num_out_rows", num_out_rows, ROW_BLOCK,
                             f"the kernel writes whole blocks of {ROW_BLOCK} rows")
    num_experts = group_sizes.shape[0]
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    smoothed = smooth_scales is not None
    if smoothed:
        _common.require_shape("smooth_scales", smooth_scales, (num_experts, width))
        _common.require_dtype("smooth_scales", smooth_scales, jnp.float32)
    if a_rows % ROW_BLOCK:  # every block the kernel reads must lie inside `a`
        a = jnp.pad(a, ((0, ROW_BLOCK - a_rows % ROW_BLOCK), (0, 0)))
    in_blocks = a.shape[0] // ROW_BLOCK
    num_blocks = num_out_rows // ROW_BLOCK
    num_ctas = min(config.num_sms or _default_num_sms(), num_blocks)
    stages = config.resolve_stages(width, a.dtype.itemsize, out_dtype.itemsize)
    layout = plgpu.Layout.WGMMA
    in_transforms = _common.mma_transforms(a.dtype)
    q_transforms = _common.mma_transforms(out_dtype)
    num_chunks = width // bc

    def body(nr_ref, *refs):
        if smoothed:
            ends_ref, sizes_ref, a_ref, sm_ref, q_ref, s_ref, *scratch = refs
        else:
            a_ref, q_ref, s_ref, *scratch = refs
        cta = jax.lax.axis_index("sm")
        count = (num_blocks - cta + num_ctas - 1) // num_ctas  # >= 1: cta < num_blocks
        real_rows = nr_ref[0]
        rows_iota = plgpu.broadcasted_iota(jnp.int32, (ROW_BLOCK, bc), 0, layout=layout)

        def block_of(i):
            return cta + i * num_ctas

        def block_experts(r0, live):
            """(first, last) expert of rows [r0, r0 + live): consecutive experts, each a
            range of the block's rows (smooth scales only)."""
            return (_expert_of(ends_ref, r0, num_experts),
                    _expert_of(ends_ref, r0 + jnp.maximum(live, 1) - 1, num_experts))

        def chunk(a_smem, c, r0, live, experts, masked=True):
            """f32 [64, bc]: columns [c*bc, (c+1)*bc) of the block's Y, zero past `live`
            (`masked=False`: every row is real); `experts` from `block_experts`."""
            x = a_smem[:, pl.ds(c * bc, bc)].astype(jnp.float32)
            if not smoothed:
                return jnp.where(rows_iota < live, x, 0.0) if masked else x
            first, last = experts

            def apply(e, y):
                end = ends_ref[e]
                lo = jnp.maximum(end - sizes_ref[e], r0) - r0
                hi = jnp.minimum(end - r0, live)
                smooth = plgpu.load(sm_ref.at[e, pl.ds(c * bc, bc)],
                                    layout=layout.reduce(0), optimized=False)
                scaled = x * jax.lax.broadcast_in_dim(smooth, (ROW_BLOCK, bc), [1])
                return jnp.where((rows_iota >= lo) & (rows_iota < hi), scaled, y)

            zeros = plgpu.layout_cast(jnp.zeros((ROW_BLOCK, bc), jnp.float32), layout)
            return jax.lax.fori_loop(first, last + 1, apply, zeros)

        def row_maxima(a_smem, r0, live, experts, masked):
            """f32 [64]: max |Y| of each row of the block (pass 1)."""
            if smoothed or masked:
                amax = None
                for c in range(num_chunks):
                    m = jnp.max(jnp.abs(chunk(a_smem, c, r0, live, experts, masked)), axis=1)
                    amax = m if amax is None else jnp.maximum(amax, m)
                return amax
            # A whole block without smoothing: |x| and max are exact in the input dtype, so
            # the elementwise maxima over the chunks run on packed 16-bit pairs and only the
            # last one is widened for the row reduction (the same value as in f32).
            m = None
            for c in range(num_chunks):
                x = jnp.abs(a_smem[:, pl.ds(c * bc, bc)])
                m = x if m is None else jnp.maximum(m, x)
            return jnp.max(m.astype(jnp.float32), axis=1)

        def quantize_block(a_smem, q_smem, s_smem, r0, live, masked):
            experts = block_experts(r0, live) if smoothed else None
            scale, inv = row_scale(row_maxima(a_smem, r0, live, experts, masked), out_dtype)
            inv = jax.lax.broadcast_in_dim(inv, (ROW_BLOCK, bc), [0])
            for c in range(num_chunks):  # pass 2: the quantized values
                q_smem[:, pl.ds(c * bc, bc)] = apply_row_scale(
                    chunk(a_smem, c, r0, live, experts, masked), inv, out_dtype)
            s_smem[...] = scale

        def quantize(i, a_smem, q_smem, s_smem):
            r0 = block_of(i) * ROW_BLOCK
            live = jnp.clip(real_rows - r0, 0, ROW_BLOCK)  # real rows of this block

            @pl.when(live == ROW_BLOCK)  # every row real: no masking
            def _():
                quantize_block(a_smem, q_smem, s_smem, r0, live, masked=False)

            @pl.when(live < ROW_BLOCK)
            def _():
                quantize_block(a_smem, q_smem, s_smem, r0, live, masked=True)

        a_bufs, q_bufs, s_bufs, landed = scratch

        def load(i, slot):  # blocks past `a` (output padding: every row masked) read its last
            src = jnp.minimum(block_of(i), in_blocks - 1) * ROW_BLOCK
            plgpu.copy_gmem_to_smem(a_ref.at[pl.ds(src, ROW_BLOCK)], a_bufs.at[slot],
                                    landed.at[slot])

        jax.lax.fori_loop(0, jnp.minimum(count, stages), lambda i, c: load(i, i), None)

        def step(i, carry):
            slot = i % stages
            plgpu.barrier_wait(landed.at[slot])
            # The Q and s stores of `stages` blocks ago (two bulk groups per block) have read
            # this slot's output buffers.
            plgpu.wait_smem_to_gmem(2 * (stages - 1), wait_read_only=True)
            quantize(i, a_bufs.at[slot], q_bufs.at[slot], s_bufs.at[slot])
            plgpu.commit_smem()  # every thread's reads of a_bufs[slot] are done, too
            r0 = block_of(i) * ROW_BLOCK
            plgpu.copy_smem_to_gmem(q_bufs.at[slot], q_ref.at[pl.ds(r0, ROW_BLOCK)])
            plgpu.copy_smem_to_gmem(s_bufs.at[slot], s_ref.at[pl.ds(r0, ROW_BLOCK)])

            @pl.when(i + stages < count)
            def _():
                load(i + stages, slot)

            return carry

        jax.lax.fori_loop(0, count, step, None)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if smoothed:
        ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # [E] one past each group's rows
    kernel = plgpu.kernel(
        body,
        kernel_name="moe_quantize_row_blocks",
        out_type=(
            jax.ShapeDtypeStruct((num_out_rows, width), out_dtype),
            jax.ShapeDtypeStruct((num_out_rows,), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((stages, ROW_BLOCK, width), a.dtype, transforms=in_transforms),
            plgpu.SMEM((stages, ROW_BLOCK, width), out_dtype, transforms=q_transforms),
            plgpu.SMEM((stages, ROW_BLOCK), jnp.float32),
            plgpu.Barrier(num_barriers=stages),
        ],
        grid=(num_ctas,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_common.interpret_params(interpret),
    )
    nr = jnp.reshape(num_rows, (1,)).astype(jnp.int32)
    if smoothed:
        return kernel(nr, ends, group_sizes.astype(jnp.int32), a, smooth_scales)
    return kernel(nr, a)


def _expert_of(ends_ref, row, num_experts: int):
    """The expert owning grouped row `row`: the first e with ends[e] > row (binary search
    over the [E] group ends in GMEM; log2(E) scalar loads); E - 1 for rows past the last."""
    lo, hi = jnp.int32(0), jnp.int32(num_experts - 1)

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        right = ends_ref[mid] <= row
        return jnp.where(right, mid + 1, lo), jnp.where(right, hi, mid)

    lo, _ = jax.lax.fori_loop(0, max(num_experts - 1, 1).bit_length(), halve, (lo, hi))
    return jnp.minimum(lo, num_experts - 1)


def _default_num_sms() -> int:
    from pallas_moe.kernels.moe_forward import default_num_sms

    return default_num_sms()
