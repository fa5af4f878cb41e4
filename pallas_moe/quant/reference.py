"""Row-wise dynamic quantization: the formula shared by the kernel and the jnp reference.

For one row `y` (f32 [d]) and a target dtype with largest magnitude `qmax` (127 for int8,
448 for float8_e4m3fn), in f32 arithmetic:

    s = max_j |y_j| * fl(1 / qmax)
    Q = saturate(round(y * rcp(s)))

that is `s = max|y| / qmax` and `Q = round(y / s)`, both divisions done as a multiply by
the *correctly rounded* f32 reciprocal (`rcp(s)` = the f32 nearest to `1 / s`, as numpy's
`np.float32(1) / s`). One reciprocal per row instead of one division per element.

`rcp` is computed the same way on every backend, so the Pallas kernel, XLA on CPU or GPU
and numpy agree bit for bit (`correctly_rounded_reciprocal`): the platform's `1 / m` of the
mantissa (on the GPU both XLA and Mosaic compile an f32 division to `div.full.f32`, up to
2 ulp off: the first H100 run had 1-3 elements per sample one step off numpy), then an
exact integer remainder check that moves it to the nearest f32. The multiplies `x * S`,
`max * fl(1/qmax)` and `y * rcp(s)` are single correctly rounded f32 operations everywhere.

Rounding is round-half-to-even in both cases: for int8 `jnp.round` to the nearest integer,
for e4m3 the f32 -> e4m3 cast itself (the GPU's `cvt.rn.satfinite.e4m3x2.f32`). Saturation
clips to `[-qmax, qmax]` first (int8 never produces -128; e4m3 never NaN from a finite
value). A row whose scale would be below the smallest normal f32 (`max|y| < qmax * 2^-126`,
all zeros included) is a zero row: `s = 0` and `Q = 0`, never a NaN (this also keeps
platforms that flush subnormals in agreement). A NaN in `y` makes `s` NaN; an infinite `y`
(for example `x * S` overflowing f32) makes `s` infinite: such rows are marked by their
scale, and their `Q` is meaningless.

`quantize_row` is traced both inside the Pallas kernel (on one row held in registers) and,
vmapped, by the jnp reference, so the two backends run the same operations in the same order.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

# Largest magnitude each quantized dtype represents (and what a row's max maps to).
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
QUANTIZED_DTYPES = tuple(QMAX)  # the 8-bit dtypes rows and weights are quantized to


# Scales below this are flushed to 0 (their reciprocal would overflow f32).
_SMALLEST_NORMAL = np.float32(np.finfo(np.float32).tiny)


def qmax_of(dtype) -> float:
    """The saturation bound of a quantized dtype (int8 or float8_e4m3fn); errors otherwise."""
    dtype = jnp.dtype(dtype)
    if dtype not in QMAX:
        raise ValueError(
            f"out_dtype must be int8 or float8_e4m3fn, got {dtype.name}."
        )
    return QMAX[dtype]


# The reciprocal of a normal f32 below 2^126 is a normal f32; every scale here is below
# f32max / 127 < 2^121 (larger inputs are non-finite or flushed to zero rows).
_RCP_EXACT_BELOW = np.float32(2.0**126)
_MANTISSA_BITS = 23
_ONE_BITS = 127 << _MANTISSA_BITS  # bit pattern of 1.0f


def correctly_rounded_reciprocal(s: jax.Array, approx: jax.Array | None = None) -> jax.Array:
    """The f32 nearest to `1 / s` (round half to even), for normal positive `s < 2^126`.

    Writes `s = m * 2^k` with `m` in [1, 2) and `M = m * 2^23` (a 24-bit integer), so
    `1 / m = 2^23 / M` and the answer's mantissa is `q = round(2^47 / M)` in
    `[2^23, 2^24]`. `q0 = (1 / m) * 2^24` from the platform's division (or `approx`, any
    estimate of `1 / m` within a few ulp) is corrected with the exact remainder
    `2^47 - q * M`: it is small (|q - q0| <= 4 ulp gives |rem| < 5 M < 2^26), so int32
    arithmetic modulo 2^32 (`2^47 = 0 mod 2^32`) computes it exactly. Each step moves `q`
    by one toward the remainder's side while `|rem| > M / 2`; a tie (`2 |rem| = M`) would
    need `M` to divide `2^48`, i.e. `m = 1`, where `1 / m` is exact. Integer operations and
    power-of-two scalings are exact on every platform, so the result is the same on CPU,
    GPU and in numpy (`np.float32(1) / s`). Other inputs (NaN, inf, s >= 2^126) get the
    platform's `1 / s`.

    Args:
      s: f32 array (any shape).
      approx: test hook: an f32 estimate of `1 / m` to start from instead of the platform's
        division (same shape as `s`).

    Returns:
      f32, `s`'s shape.
    """
    s = s.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    mant = bits & ((1 << _MANTISSA_BITS) - 1)
    m = jax.lax.bitcast_convert_type(mant | _ONE_BITS, jnp.float32)  # [1, 2)
    r0 = 1.0 / m if approx is None else approx
    q = (r0 * np.float32(2.0**24)).astype(jnp.int32)  # exact: r0 in [0.5, 1]
    big_m = mant | (1 << _MANTISSA_BITS)  # M in [2^23, 2^24)
    rem = -(q * big_m)  # 2^47 - q * M, exact modulo 2^32
    for _ in range(4):  # div.full.f32 is within 2 ulp; one step of margin
        up = 2 * rem > big_m
        down = 2 * rem < -big_m
        q = q + up.astype(jnp.int32) - down.astype(jnp.int32)
        rem = rem - jnp.where(up, big_m, 0) + jnp.where(down, big_m, 0)
    # 1/s = (q * 2^-24) * 2^(127 - e), e the biased exponent of s: assembled as bits (a
    # float product could be reassociated through a subnormal and flushed, as XLA:CPU does).
    exponent = jax.lax.shift_right_logical(bits, _MANTISSA_BITS) & 0xFF
    whole = q >> (_MANTISSA_BITS + 1)  # 1 when q = 2^24 (m = 1: 1/s is a power of two)
    result_bits = ((253 + whole - exponent) << _MANTISSA_BITS) | (
        (q >> whole) & ((1 << _MANTISSA_BITS) - 1)
    )
    exact = jax.lax.bitcast_convert_type(result_bits, jnp.float32)
    usable = (s >= np.float32(np.finfo(np.float32).tiny)) & (s < _RCP_EXACT_BELOW)
    return jnp.where(usable, exact, 1.0 / jnp.where(usable, 1.0, s))


def quantize_row(
    y: jax.Array, out_dtype, reciprocal=correctly_rounded_reciprocal
) -> tuple[jax.Array, jax.Array]:
    """Quantizes one f32 row with its own absmax scale.

    Args:
      y: f32 [d].
      out_dtype: int8 or float8_e4m3fn.
      reciprocal: computes `correctly_rounded_reciprocal` of the f32 scalar scale (the
        Pallas kernel passes a version that runs it on a vector: Mosaic GPU cannot bitcast
        a scalar).

    Returns:
      `(q, s)`: q [d] in out_dtype and the f32 scalar scale s, with `q * s ~= y`.
    """
    scale, inv_scale = row_scale(jnp.max(jnp.abs(y)), out_dtype, reciprocal)
    return apply_row_scale(y, inv_scale, out_dtype), scale


def absmax_scale(amax: jax.Array, out_dtype) -> tuple[jax.Array, jax.Array]:
    """`(s, zero_row)` of rows with absmax `amax` (f32, any shape): `s = amax * fl(1/qmax)`,
    flushed to 0 below the smallest normal f32 (`zero_row`, False for NaN, so a NaN row
    keeps s = NaN). `row_scale` adds the reciprocal."""
    scale = amax * np.float32(1.0 / qmax_of(out_dtype))
    zero_row = scale < _SMALLEST_NORMAL
    return jnp.where(zero_row, 0.0, scale), zero_row


def row_scale(amax: jax.Array, out_dtype, reciprocal=correctly_rounded_reciprocal):
    """`(s, rcp(s))` of rows with absmax `amax` (f32, any shape; `quantize_row`'s formula:
    zero rows get 0 and 0). Kernels that hold a row in pieces reduce `amax` themselves."""
    scale, zero_row = absmax_scale(amax, out_dtype)
    inv_scale = jnp.where(zero_row, 0.0, reciprocal(jnp.where(zero_row, 1.0, scale)))
    return scale, inv_scale


def apply_row_scale(y: jax.Array, inv_scale: jax.Array, out_dtype) -> jax.Array:
    """`saturate(round(y * inv_scale))` in out_dtype (`quantize_row`'s formula); `inv_scale`
    broadcasts against y."""
    qmax = qmax_of(out_dtype)
    v = jnp.clip(y * inv_scale, -qmax, qmax)
    if jnp.dtype(out_dtype) == jnp.int8:
        v = jnp.round(v)  # round half to even
    return v.astype(out_dtype)


def quantize_absmax(w: jax.Array, out_dtype, axis: int) -> tuple[jax.Array, jax.Array]:
    """Quantizes `w` with one absmax scale per slice along `axis` (the `quantize_row` formula).

    Args:
      w: float array of any shape; computed in f32.
      out_dtype: int8 or float8_e4m3fn.
      axis: the axis each scale reduces over.

    Returns:
      `(q, s)`: q with w's shape in out_dtype; s f32 with `axis` removed.
    """
    moved = jnp.moveaxis(w.astype(jnp.float32), axis, -1)
    lead = moved.shape[:-1]
    q, s = jax.vmap(lambda r: quantize_row(r, out_dtype))(moved.reshape(-1, moved.shape[-1]))
    return jnp.moveaxis(q.reshape(moved.shape), -1, axis), s.reshape(lead)


def smoothquant_rows_reference(
    x: jax.Array,
    smooth_scales: jax.Array,
    token_ids: jax.Array,
    expert_ids: jax.Array,
    row_is_valid: jax.Array,
    out_dtype,
    *,
    rows_per_step: int = 1024,
) -> tuple[jax.Array, jax.Array]:
    """jnp reference of the fused MoE SmoothQuant, one output row per (token, expert) row.

    Row r is `quantize_row(x[token_ids[r]] * smooth_scales[expert_ids[r]])`; rows with
    `row_is_valid[r] == False` get Q = 0 and s = 0. Walks `rows_per_step` rows at a time
    (`lax.map`), so it never holds more than that many gathered rows.

    Args:
      x: [T, d] bf16 or fp16.
      smooth_scales: f32 [E, d].
      token_ids: i32 [R] source token of each output row.
      expert_ids: i32 [R] expert of each output row, in [0, E) (clamped).
      row_is_valid: bool [R].
      out_dtype: int8 or float8_e4m3fn.
      rows_per_step: rows quantized per `lax.map` step.

    Returns:
      `(q [R, d] out_dtype, s f32 [R])`.
    """
    num_experts = smooth_scales.shape[0]

    def one_row(args):
        tok, e, valid = args
        y = x[tok].astype(jnp.float32) * smooth_scales[jnp.clip(e, 0, num_experts - 1)]
        q, s = quantize_row(y, out_dtype)
        return jnp.where(valid, q, jnp.zeros_like(q)), jnp.where(valid, s, 0.0)

    return jax.lax.map(one_row, (token_ids, expert_ids, row_is_valid), batch_size=rows_per_step)


# ---- the fp8 forward's stated accuracy (the GPU tests and `benchmarks/quant.py --fp8`)

# Relative (Frobenius) error of the fp8 layer against the bf16 layer on N(0,1) data: four
# e4m3 quantizations (X, W1, A, W2), each ~3.6% RMS relative per element, give ~7%.
FP8_VS_BF16_TOL = 0.1
E4M3_RELATIVE_STEP = 2.0**-3  # an e4m3 step (3 mantissa bits) over the value it sits on, at most
# Margin on the requantization estimate below for the sampling of which elements flip.
FLIP_MARGIN = 1.25
# The bf16 rounding of both compared outputs, relative.
BF16_OUTPUT_ROUNDING = 2.0**-8


def requantization_bound(eps_a: float, eps_rest: float) -> float:
    """End-to-end bound on the fp8 forward's relative error against the XLA steps, from the
    relative error `eps_a` of the kernels' A against the reference's A (the H100's fp8
    wgmma truncates its sums, `tests/fp8_wgmma_model.py`) and `eps_rest` of the later steps
    on the kernels' own inputs (the down-proj's `eps_y` plus `BF16_OUTPUT_ROUNDING`).

    A's requantization turns small differences into whole e4m3 steps: an element u (in e4m3
    units) perturbed by d flips to the next e4m3 value with probability ~|d| / h, where the
    step h <= u / 8, and a flip moves it by h. So ||dQ||^2 ~ sum |d| h <= 2^-3 ||d|| ||u||
    (Cauchy-Schwarz), i.e. ||dQ|| / ||Q|| <= sqrt(eps_a / 8), plus the unflipped d itself.
    The down-proj and the aggregation are linear, so the relative error carries through
    (session 4: eps_a ~ 2e-3 gives 0.016, the 0.0163-0.0169 the H100 measured)."""
    return float(FLIP_MARGIN * np.sqrt(eps_a * E4M3_RELATIVE_STEP) + eps_a + eps_rest)
