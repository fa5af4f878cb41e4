"""`pm.quant.moe_smoothquant`: MoE SmoothQuant with the token gather fused.

Each routed (token t, expert e) row becomes `Y = x[t] * S[e]` (f32), quantized row-wise
with its own scale: `s = max|Y| / qmax`, `Q = round(Y / s)` (formula, rounding and
saturation in `quant/reference.py`). Two layouts:

- `moe_smoothquant(x, S, plan)`: rows in the plan's grouped order, `Q [P, d]` and `s [P]`,
  ready for a grouped GEMM; padding rows get Q = 0, s = 0. The kernel backends run the
  token-walking CSR kernel (`quant.kernel.smoothquant_kernel`).
- `moe_smoothquant_topk(x, S, topk_ids)`: the CK-tile operator's own layout,
  `Q [T, K, d]` and `s [T, K]` (the CSR kernel: its rows are in token order, so
  consecutive rows belong to different experts and no block shares a scale row).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe import _checks
from pallas_moe.ops.moe_ffn import resolve_backend
from pallas_moe.quant.kernel import SmoothQuantConfig, smoothquant_kernel, supports_width
from pallas_moe.quant.reference import qmax_of, smoothquant_rows_reference
from pallas_moe.routing.plan import DispatchPlan

Backend = Literal["auto", "mosaic", "interpret", "xla"]
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_inputs(x, smooth_scales, out_dtype) -> None:
    _checks.check_floating("x", x, ndim=2)
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must be bf16 or fp16, got {x.dtype}.")
    _checks.check_floating("smooth_scales", smooth_scales, ndim=2)
    if smooth_scales.dtype != jnp.float32:
        raise TypeError(f"smooth_scales must be f32 [E, d], got {smooth_scales.dtype}.")
    if smooth_scales.shape[1] != x.shape[1]:
        raise ValueError(
            f"smooth_scales must be [E, d] with d={x.shape[1]} from x, got {smooth_scales.shape}."
        )
    qmax_of(out_dtype)


def _backend(backend: str, d: int) -> str:
    """`auto` -> `mosaic` on a Hopper GPU for widths the kernel takes, else `xla`."""
    resolved = resolve_backend(backend)
    if backend == "auto" and resolved == "mosaic" and not supports_width(d):
        return "xla"
    return resolved


def _interpret(backend: str, interpret_params):
    if backend == "interpret":
        return interpret_params or True
    return False


def moe_smoothquant(
    x: jax.Array,
    smooth_scales: jax.Array,
    plan: DispatchPlan,
    *,
    out_dtype=jnp.int8,
    backend: Backend = "auto",
    config: SmoothQuantConfig | None = None,
    interpret_params: plgpu.InterpretGPUParams | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Smooths and quantizes every routed row, in the plan's grouped order.

    Row r (token t = plan.token_ids[r], expert e = the group holding r) becomes
    `quantize_row(x[t] * S[e])` (`quant/reference.py`); rows past `plan.num_rows` get Q = 0,
    s = 0 whatever x holds.

    The kernel backends ("mosaic", "interpret") run the token-walking CSR kernel
    (`quant.kernel.smoothquant_kernel`: each X row read once, one f32 scale row read per
    output row, each row reduced across the warpgroup).

    Args:
      x: [T, d] bf16 or fp16 tokens.
      smooth_scales: f32 [E, d], each expert's per-channel smooth scale S (multiplied in;
        `calibrate_smoothing` computes it).
      plan: the `DispatchPlan` (rows grouped by expert).
      out_dtype: int8 (default, as in the CK-tile operator) or float8_e4m3fn.
      backend: "mosaic" (the Pallas kernels on a Hopper GPU), "interpret" (the same kernels
        in Mosaic GPU interpret mode, for CPU tests), "xla" (the jnp reference, runs
        anywhere) or "auto" (mosaic on Hopper when `d` is a multiple of 128, else xla).
      config: None (the CSR kernel's defaults) or a `SmoothQuantConfig` (its block sizes);
        anything else raises a TypeError.
      interpret_params: interpret-mode settings (e.g. `detect_races=True`) for "interpret".

    Returns:
      `(q, s)`: q [P, d] in out_dtype and s f32 [P], with `q[r] * s[r] ~= x[tok[r]] * S[e(r)]`
      for real rows and q = 0, s = 0 on padding rows.
    """
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a pallas_moe.routing.DispatchPlan, got {type(plan).__name__}.")
    _check_inputs(x, smooth_scales, out_dtype)
    if plan.num_tokens != x.shape[0]:
        raise ValueError(f"plan was built for T={plan.num_tokens} tokens but x has T={x.shape[0]}.")
    if plan.num_experts != smooth_scales.shape[0]:
        raise ValueError(
            f"smooth_scales has {smooth_scales.shape[0]} experts but the plan routes to "
            f"E={plan.num_experts}."
        )
    # One kernel per op: a config meant for another kernel (e.g. the removed gathered
    # row-block kernel's) must fail loudly, not silently run the CSR kernel's defaults.
    if config is not None and not isinstance(config, SmoothQuantConfig):
        raise TypeError(
            "config must be None or a pallas_moe.quant.SmoothQuantConfig (the CSR kernel's "
            f"block sizes), got {type(config).__name__}."
        )
    backend = _backend(backend, x.shape[1])
    if backend == "xla":
        return smoothquant_rows_reference(
            x, smooth_scales, plan.token_ids, plan.expert_ids, plan.row_is_valid, out_dtype
        )
    interpret = _interpret(backend, interpret_params)
    # The CSR kernel walks tokens: each token's rows from the plan's CSR, with their experts.
    row_experts = jnp.minimum(plan.expert_ids[plan.rows_by_token], plan.num_experts - 1)
    return smoothquant_kernel(
        x, smooth_scales, plan.token_row_offsets, plan.rows_by_token, row_experts,
        plan.num_rows, num_out_rows=plan.capacity, out_dtype=out_dtype,
        config=config or SmoothQuantConfig(), interpret=interpret,
    )


def moe_smoothquant_topk(
    x: jax.Array,
    smooth_scales: jax.Array,
    topk_ids: jax.Array,
    *,
    out_dtype=jnp.int8,
    backend: Backend = "auto",
    config: SmoothQuantConfig = SmoothQuantConfig(),
    interpret_params: plgpu.InterpretGPUParams | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The CK-tile operator's layout: quantizes `x[t] * S[topk_ids[t, k]]` into `Q[t, k]`.

    Args:
      x: [T, d] bf16 or fp16.
      smooth_scales: f32 [E, d].
      topk_ids: integer [T, K], expert of each of token t's K choices. Out-of-range ids raise
        a ValueError when the ids are concrete; under `jit` their rows get s = NaN (and a
        meaningless Q), so they cannot pass for real data.
      out_dtype, backend, interpret_params: as in `moe_smoothquant`.
      config: the CSR kernel's block sizes (this layout always runs the CSR kernel).

    Returns:
      `(q [T, K, d] out_dtype, s f32 [T, K])`.
    """
    _check_inputs(x, smooth_scales, out_dtype)
    if not hasattr(topk_ids, "dtype") or not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids must be an integer array, got {getattr(topk_ids, 'dtype', type(topk_ids))}.")
    num_tokens, d = x.shape
    num_experts = smooth_scales.shape[0]
    if topk_ids.ndim != 2 or topk_ids.shape[0] != num_tokens or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [T, K] with T={num_tokens} from x, got {topk_ids.shape}.")
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    if not isinstance(ids, jax.core.Tracer):
        bad = np.asarray((ids < 0) | (ids >= num_experts))
        if bad.any():
            raise ValueError(
                f"topk_ids must be in [0, E={num_experts}); got {int(bad.sum())} ids outside, "
                f"e.g. {int(np.asarray(ids)[bad][0])}."
            )
    in_range = (ids >= 0) & (ids < num_experts)
    experts = jnp.clip(ids, 0, num_experts - 1)
    backend = _backend(backend, d)
    if backend == "xla":
        rows = jnp.arange(num_tokens * k, dtype=jnp.int32)
        q, s = smoothquant_rows_reference(
            x, smooth_scales, rows // k, experts, jnp.ones_like(in_range), out_dtype
        )
    else:
        q, s = smoothquant_kernel(
            x, smooth_scales, jnp.arange(num_tokens + 1, dtype=jnp.int32) * k,
            jnp.arange(num_tokens * k, dtype=jnp.int32), experts, None,
            num_out_rows=num_tokens * k, out_dtype=out_dtype, config=config,
            interpret=_interpret(backend, interpret_params),
        )
    s = jnp.where(in_range, s, jnp.nan)
    return q.reshape(num_tokens, k, d), s.reshape(num_tokens, k)
