"""Session 27: a copy of the CSR kernel as session 26 left it (pallas_moe/quant/kernel.py at
49b2a49) up to its CSR kernel (the rest of that file is unchanged in the tree), the baseline
of `quant_groups.py`'s A/B.

Fused MoE SmoothQuant kernel (Pallas Mosaic GPU): gather, smooth, row-wise quantize.

For every routed (token t, expert e) row written to output row r:

    Y = x[t] * S[e]  (f32);   Q[r], s[r] = quantize_row(Y)   (see `quant/reference.py`)

The kernel walks *tokens*, not output rows: one CTA (one warpgroup) loads `x[t]` from HBM
into registers once (a strided warpgroup layout, `vec` contiguous elements per thread) and
then, for each of the token's rows (CSR: `row_offsets[t]:row_offsets[t+1]`), loads the
expert's smooth-scale row (`E * d * 4` bytes in all, so it stays in L2), reduces `max|Y|`
across the warpgroup, and stores the quantized row and its scale at the row's output
position. So X is read once (`T * d` elements) however many experts a token has, and no
gathered `[P, d]` copy exists: the kernel moves `T*d*sizeof(x) + P*d*sizeof(Q) + 4*P` bytes
plus metadata and the L2-resident scales. The next row's smooth-scale load is issued before
the current row is reduced, to overlap its latency.

Output rows that no token owns (the plan's padding rows `[num_rows, P)`) are written as
Q = 0, s = 0 by extra CTAs at the end of the grid.

Rows that are already in grouped order (the fp8 forward's A) take the row-block quantizer
below instead (`quantize_row_blocks`): whole 64-row blocks through SMEM, each row reduced
inside one quad of threads of the wgmma register layout, with no barrier per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.quant.reference import (
    absmax_scale, apply_row_scale, correctly_rounded_reciprocal, qmax_of, row_scale,
)

_WG = 128  # threads in a warpgroup
_VECS = (8, 4, 2, 1)


@dataclasses.dataclass(frozen=True)
class SmoothQuantConfig:
    """Block sizes of the fused SmoothQuant kernel.

    Attributes:
      block_t: tokens per CTA (walked one after another).
      block_pad: padding rows zeroed per CTA of the padding part of the grid.
      vec: elements each thread loads per access (8 -> 16-byte bf16 loads); `d` must be a
        multiple of `128 * vec`. None picks the largest of 8, 4, 2, 1 that divides.
      scale_rows_ahead: with smooth scales, how many rows ahead of the one being quantized
        the smooth-scale rows are loaded (each costs `d / 128` registers per thread; the
        expert id one row further is loaded with them, so no scale load waits on its id).
        Measured on an H200 (session 25, 1 against session 24's loop, where the next row's
        scale load waited on its expert id's load): 1.07-1.11x, the same bits.
        Rows 2 or 3 ahead were 0.63-0.81x at 7B and 30B (H200, session 26; presumably
        their registers).
      int8_rounding: how compiled kernels round int8 values (`_saturating_quantize`; the
        same bits for every finite row): "fadd" (default: an f32 add of 1.5 * 2^23 on the
        full-rate FP32 pipe; H200, session 26, bitwise: int8 1.05x at 7B, 1.10x at 30B) or
        "cvt" (`cvt.rni.sat.s8.f32`, the quarter-rate conversion pipe).
    """

    block_t: int = 1
    block_pad: int = 64
    vec: int | None = None
    scale_rows_ahead: int = 1
    int8_rounding: str = "fadd"

    def __post_init__(self):
        if self.int8_rounding not in ("cvt", "fadd"):
            raise ValueError(
                f'config.int8_rounding must be "cvt" or "fadd", got {self.int8_rounding!r}.'
            )
        if self.scale_rows_ahead < 1:
            raise ValueError(
                f"config.scale_rows_ahead={self.scale_rows_ahead} must be >= 1 (smooth-scale "
                "rows loaded ahead of the row being quantized)."
            )

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


def _rcp_rn(splat: jax.Array) -> jax.Array:
    """`correctly_rounded_reciprocal` of a warpgroup-splat f32 vector on the GPU: PTX
    `rcp.rn.f32`, the IEEE round-to-nearest-even reciprocal (NaN -> NaN, inf -> 0), which is
    that function's value on every input the kernel gives it (normal scales below 2^126,
    NaN, inf). One instruction sequence per thread instead of the remainder-corrected
    division, which Mosaic GPU compiles from `div.full.f32` plus four correction steps.
    A splat holds one register per thread, so each thread computes it once per row."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    layout = plgpu.Layout.WG_SPLAT(splat.shape)

    @plgpu.inline_mgpu(
        arg_types=(layout,),
        return_type=plgpu.ShapeDtypeStruct(splat.shape, jnp.float32, layout=layout),
    )
    def rcp(ctx, v):
        del ctx
        f32 = ir.F32Type.get()
        return v._pointwise(lambda r: llvm.inline_asm(
            f32, [r], "rcp.rn.f32 $0, $1;", "=f,f", has_side_effects=False))

    return rcp(splat)


# int8 rounding by an f32 add (`int8_rounding="fadd"`): 1.5 * 2^23, whose ulp is 1, so
# `add.rn.f32 v, 0f4B400000` rounds v half to even to an integer held in the low mantissa
# bits, as two's complement in the low byte. `.rn` keeps ptxas from fusing the add with the
# multiply `y * rcp(s)` before it into an fma (which would round the exact product instead).
_INT8_ROUND_ASM = "{ .reg .f32 t; add.rn.f32 t, $1, 0f4B400000; mov.b32 $0, t; }"


_INT8_ROUNDINGS = {"cvt": "cvt.rni.sat.s8.f32 $0, $1;", "fadd": _INT8_ROUND_ASM}


def _saturating_quantize(v: jax.Array, out_dtype, layout, int8_rounding: str) -> jax.Array:
    """`apply_row_scale`'s `saturate(round(v))` on the GPU, in fewer instructions, for the
    values `v = y * rcp(s)` of a finite row (|v| <= qmax within a few ulp):
      e4m3: the cast alone (`cvt.rn.satfinite.e4m3x2.f32` rounds half to even and clips to
        +-448 itself, as the clip would; NaN stays NaN);
      int8, `int8_rounding="cvt"`: `cvt.rni.sat.s8.f32` per element (round half to even,
        then saturate to [-128, 127]; |v| < 127.5 here, so never -128, as the clip to +-127
        guarantees);
      int8, "fadd": an f32 add of 1.5 * 2^23 (`_INT8_ROUND_ASM`, the full-rate FP32 pipe
        instead of the conversion pipe) and the low byte of its bits: round half to even,
        the same integer, since |v| < 127.5 needs no saturation. Rows whose scale is NaN or
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
                    i32, [vector.extract(reg, [], [i])], _INT8_ROUNDINGS[int8_rounding], "=r,f",
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
    layout = plgpu.Layout.WG_STRIDED((d,), vec_size=vec)
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
        sm_ref, q_ref, s_ref = rest if smoothed else (None, *rest)
        cta = jax.lax.axis_index("cta")

        def load_token(t):
            """X row, CSR bounds and first output row of token t: [d] and three i32 scalars
            (the row index clamped for a token without rows past the last entry)."""
            start = off_ref[t]
            first_row = start if smoothed else rows_ref[jnp.minimum(start, num_entries - 1)]
            return plgpu.load(x_ref.at[t], layout=layout), start, off_ref[t + 1], first_row

        def store_at(r, q, s):
            q_ref[r] = q
            s_ref[r] = s

        def quantize(y):
            """`quantize_row(y)`: one warpgroup reduction for the row's max, then the scale
            and its reciprocal on a splat of it (one register per thread: Mosaic GPU cannot
            bitcast a scalar, which the jnp reciprocal does), so every thread has the
            reciprocal with no second reduction."""
            amax = jnp.max(jnp.abs(y))
            scale, _ = absmax_scale(amax, out_dtype)  # the f32 scalar stored as s
            _, inv = row_scale(jnp.full(y.shape, amax, jnp.float32), out_dtype, reciprocal)
            if interpret:
                return apply_row_scale(y, inv, out_dtype), scale
            return _saturating_quantize(y * inv, out_dtype, layout, config.int8_rounding), scale

        def smoothed_rows(xt, start, stop):
            xf = xt.astype(jnp.float32)  # once per token, not per row
            last = stop - 1
            ahead = config.scale_rows_ahead

            def expert(j):  # the expert of CSR entry j (the last entry's past the end)
                return exp_ref[jnp.minimum(j, last)]

            def smooth_row(e):
                return plgpu.load(sm_ref.at[e], layout=layout)

            def row(j, carry):
                # Each load's address was loaded a row earlier, so no load waits on another
                # within a row: the scale row `ahead` rows on (its expert id came with the
                # previous row), the expert id one further and the next output row, all
                # issued before this row's reduction.
                *smooth, next_expert, out_row = carry
                later = (smooth_row(next_expert), expert(j + ahead + 1),
                         rows_ref[jnp.minimum(j + 1, last)])
                store_at(out_row, *quantize(xf * smooth[0]))
                return (*smooth[1:], *later)

            first = (*(smooth_row(expert(start + i)) for i in range(ahead)),
                     expert(start + ahead), rows_ref[start])
            jax.lax.fori_loop(start, stop, row, first)

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
        interpret=_common.interpret_params(interpret),
    )
    args = [row_offsets.astype(jnp.int32), out_rows.astype(jnp.int32), row_experts.astype(jnp.int32)]
    if num_rows is not None:
        args.append(jnp.reshape(num_rows, (1,)).astype(jnp.int32))
    args.append(x)
    if smoothed:
        args.append(smooth_scales.astype(jnp.float32))
    return kernel(*args)


