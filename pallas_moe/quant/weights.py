"""Weight quantization and SmoothQuant calibration for the quantized MoE path (pure jnp).

Weights use the library's layout: `w_gate_up [E, d, 2n]`, `w_down [E, n, d]`, i.e.
`[E, in, out]`. They are quantized per expert and per output channel (one f32 scale per
column of each expert's matrix), with the row formula of `quant/reference.py` applied down
each column.

SmoothQuant (Xiao et al. 2023) moves activation outliers into the weights: with
`a_j = max|X_j|` over the rows an expert sees and `w_j = max_o |W[j, o]|`, the per-channel
factor is `f_j = a_j^alpha / w_j^(1 - alpha)`. The activations are divided by `f` and the
weights' input rows multiplied by it, so `(X / f) @ (diag(f) W) = X @ W`. The fused
quantization kernel multiplies by its smooth scale, so `smooth_scales = 1 / f`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.quant.reference import quantize_absmax
from pallas_moe.routing.plan import DispatchPlan


def quantize_weights(
    w: jax.Array, *, out_dtype=jnp.float8_e4m3fn, k_major: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Per-expert, per-output-channel absmax quantization of `[E, in, out]` weights.

    Args:
      w: [E, in, out] float weights (e.g. `w_gate_up` [E, d, 2n] or `w_down` [E, n, d]).
      out_dtype: float8_e4m3fn (default) or int8.
      k_major: return q transposed, `[E, out, in]`: the layout the fp8 grouped GEMM reads
        (8-bit wgmma takes its B operand only K-major).

    Returns:
      `(q, scales)`: q [E, in, out] (`[E, out, in]` if k_major) in out_dtype and scales
      f32 [E, out] with `q[e, :, o] * scales[e, o] ~= w[e, :, o]`; an all-zero column gets
      scale 0 and q = 0.
    """
    _checks.check_floating("w", w, ndim=3)
    if k_major:
        return quantize_absmax(jnp.swapaxes(w, 1, 2), out_dtype, axis=2)
    return quantize_absmax(w, out_dtype, axis=1)


def dequantize_weights(
    q: jax.Array, scales: jax.Array, dtype=jnp.float32, *, k_major: bool = False
) -> jax.Array:
    """Inverse of `quantize_weights`: `q [E, in, out] * scales [E, out]` in `dtype`, always
    returned `[E, in, out]` (`k_major`: q is `[E, out, in]`)."""
    if k_major and q.ndim == 3:
        q = jnp.swapaxes(q, 1, 2)
    if q.ndim != 3 or scales.shape != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"q must be [E, in, out] ([E, out, in] if k_major) and scales [E, out]; got "
            f"{q.shape} and {scales.shape}."
        )
    return (q.astype(jnp.float32) * scales[:, None, :]).astype(dtype)


def expert_activation_absmax(
    x: jax.Array,
    plan: DispatchPlan,
    running: jax.Array | None = None,
    *,
    rows_per_step: int = 1024,
) -> jax.Array:
    """Per-expert, per-channel `max|x|` over the tokens routed to each expert.

    Call it on calibration batches, passing the previous result as `running`. Walks the plan's
    rows `rows_per_step` at a time, so it never gathers more rows than that.

    Args:
      x: [T, d] activations entering the experts.
      plan: the batch's `DispatchPlan`.
      running: f32 [E, d] statistics of earlier batches, or None.
      rows_per_step: rows gathered per step.

    Returns:
      f32 [E, d]; 0 for experts that saw no rows.
    """
    _checks.check_floating("x", x, ndim=2)
    if plan.num_tokens != x.shape[0]:
        raise ValueError(f"plan was built for T={plan.num_tokens} tokens but x has T={x.shape[0]}.")
    num_experts, d = plan.num_experts, x.shape[1]
    if running is not None:
        _checks.check_floating("running", running, ndim=2)
        if running.shape != (num_experts, d):
            raise ValueError(f"running must be [E, d] = {(num_experts, d)}, got {running.shape}.")
    _checks.check_positive_int("rows_per_step", rows_per_step)
    steps = -(-plan.capacity // rows_per_step)
    pad = steps * rows_per_step - plan.capacity
    tokens = jnp.pad(plan.token_ids, (0, pad)).reshape(steps, rows_per_step)
    experts = jnp.pad(plan.expert_ids, (0, pad), constant_values=num_experts)
    experts = experts.reshape(steps, rows_per_step)

    def step(acc, chunk):
        tok, e = chunk
        rows = jnp.abs(x[tok].astype(jnp.float32))  # [rows_per_step, d]
        # Padding rows go to segment E, which is dropped.
        m = jax.ops.segment_max(rows, e, num_segments=num_experts + 1)[:num_experts]
        return jnp.maximum(acc, m), None

    init = jnp.zeros((num_experts, d), jnp.float32)
    out, _ = jax.lax.scan(step, init, (tokens, experts))
    return out if running is None else jnp.maximum(out, running.astype(jnp.float32))


def calibrate_smoothing(
    act_absmax: jax.Array, w: jax.Array, *, alpha: float = 0.5
) -> tuple[jax.Array, jax.Array]:
    """SmoothQuant factors per expert and input channel, and the weights with them folded in.

    `f[e, j] = act_absmax[e, j]^alpha / max_o |w[e, j, o]|^(1 - alpha)`; a channel where either
    maximum is 0 (an expert that saw no rows, a dead channel) keeps `f = 1`.

    Args:
      act_absmax: f32 [E, in], from `expert_activation_absmax`.
      w: [E, in, out] the weights that consume the activations (`w_gate_up` for the up-proj).
      alpha: migration strength in [0, 1]; 0.5 is the paper's default, larger moves more of
        the activation range into the weights.

    Returns:
      `(smooth_scales, w_smoothed)`: f32 [E, in] equal to `1 / f` (what `moe_smoothquant`
      multiplies the activations by), and `w * f[:, :, None]` in w's dtype, so that
      `(x * smooth_scales[e]) @ w_smoothed[e] ~= x @ w[e]`.
    """
    _checks.check_floating("w", w, ndim=3)
    _checks.check_floating("act_absmax", act_absmax, ndim=2)
    if act_absmax.shape != w.shape[:2]:
        raise ValueError(f"act_absmax must be [E, in] = {w.shape[:2]} from w, got {act_absmax.shape}.")
    if not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}.")
    a = act_absmax.astype(jnp.float32)
    wmax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=2)  # [E, in]
    usable = (a > 0) & (wmax > 0)
    f = jnp.where(usable, a ** alpha / jnp.where(usable, wmax, 1.0) ** (1.0 - alpha), 1.0)
    w_smoothed = (w.astype(jnp.float32) * f[:, :, None]).astype(w.dtype)
    return 1.0 / f, w_smoothed
