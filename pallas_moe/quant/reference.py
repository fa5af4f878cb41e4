"""Row-wise dynamic quantization: the formula shared by the kernel and the jnp reference.

For one row `y` (f32 [d]) and a target dtype with largest magnitude `qmax` (127 for int8,
448 for float8_e4m3fn), in f32 arithmetic:

    s = max_j |y_j| * fl(1 / qmax)
    Q = saturate(round(y * fl(1 / s)))

that is `s = max|y| / qmax` and `Q = round(y / s)`, with both divisions done as a multiply
by a correctly rounded f32 reciprocal. That is what XLA compiles `y / s` into anyway (it
rewrites division by a constant or a broadcast scalar), so spelling it out keeps the kernel,
the XLA reference and numpy on one bit-exact definition; it also leaves the kernel one
division per row instead of one per element.

Rounding is round-half-to-even in both cases: for int8 `jnp.round` to the nearest integer,
for e4m3 the f32 -> e4m3 cast itself (the GPU's `cvt.rn.satfinite.e4m3x2.f32`). Saturation
clips to `[-qmax, qmax]` first (int8 never produces -128). A row whose scale would be below
the smallest normal f32 (`max|y| < qmax * 2^-126`, all zeros included) is a zero row:
`s = 0` and `Q = 0`, never a NaN (this also keeps platforms that flush subnormals in
agreement). A NaN in `y` makes `s` NaN; an infinite `y` (for example `x * S` overflowing
f32) makes `s` infinite: such rows are marked by their scale, and their `Q` is meaningless.

`quantize_row` is traced both inside the Pallas kernel (on one row held in registers) and,
vmapped, by the jnp reference, so the two backends run the same operations in the same order.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

# Largest magnitude each quantized dtype represents (and what a row's max maps to).
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


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


def quantize_row(y: jax.Array, out_dtype) -> tuple[jax.Array, jax.Array]:
    """Quantizes one f32 row with its own absmax scale.

    Args:
      y: f32 [d].
      out_dtype: int8 or float8_e4m3fn.

    Returns:
      `(q, s)`: q [d] in out_dtype and the f32 scalar scale s, with `q * s ~= y`.
    """
    qmax = qmax_of(out_dtype)
    amax = jnp.max(jnp.abs(y))
    scale = amax * np.float32(1.0 / qmax)
    zero_row = scale < _SMALLEST_NORMAL  # False for NaN, so a NaN row keeps s = NaN
    scale = jnp.where(zero_row, 0.0, scale)
    inv_scale = jnp.where(zero_row, 0.0, 1.0 / jnp.where(zero_row, 1.0, scale))
    v = jnp.clip(y * inv_scale, -qmax, qmax)
    if jnp.dtype(out_dtype) == jnp.int8:
        v = jnp.round(v)  # round half to even
    return v.astype(out_dtype), scale


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
