"""Quantized MoE inference: fused MoE SmoothQuant (int8 / fp8 e4m3) and weight quantization.

- `moe_smoothquant(x, smooth_scales, plan, *, out_dtype)`: `Q [P, d]`, `s f32 [P]` in the
  plan's grouped order, the token gather fused (Pallas Mosaic GPU CSR kernel; jnp reference).
- `moe_smoothquant_topk(x, smooth_scales, topk_ids, *, out_dtype)`: `Q [T, K, d]`, `s [T, K]`.
- `quantize_tokens_kernel(x)`: `Q [T, d]`, `s f32 [T]`, each token once (no smoothing).
- `quantize_row_blocks(a, smooth_scales, group_sizes, num_rows, ...)`: rows already in
  grouped order (the fp8 forward's A), 64-row blocks through SMEM, optional per-expert scales.
- `quantize_weights` / `dequantize_weights`: per-expert, per-output-channel e4m3 (or int8).
- `expert_activation_absmax`, `calibrate_smoothing`: SmoothQuant calibration.
- `quantize_experts`, `moe_ffn_fp8`: the fp8 (e4m3) inference forward of a SwiGLU MoE layer
  (fp8 grouped GEMMs with dequantizing epilogues; inference only).
"""

from pallas_moe.quant.ffn import Fp8ForwardConfig, QuantizedExperts, moe_ffn_fp8, quantize_experts
from pallas_moe.quant.kernel import (
    RowBlockQuantConfig,
    SmoothQuantConfig,
    quantize_row_blocks,
    quantize_tokens_kernel,
    smoothquant_kernel,
)
from pallas_moe.quant.reference import QMAX, quantize_absmax, quantize_row
from pallas_moe.quant.smoothquant import moe_smoothquant, moe_smoothquant_topk
from pallas_moe.quant.weights import (
    calibrate_smoothing,
    dequantize_weights,
    expert_activation_absmax,
    quantize_weights,
)

__all__ = [
    "moe_smoothquant", "moe_smoothquant_topk", "SmoothQuantConfig", "smoothquant_kernel",
    "quantize_tokens_kernel", "quantize_row_blocks", "RowBlockQuantConfig",
    "QMAX", "quantize_row", "quantize_absmax",
    "quantize_weights", "dequantize_weights", "expert_activation_absmax", "calibrate_smoothing",
    "moe_ffn_fp8", "quantize_experts", "QuantizedExperts", "Fp8ForwardConfig",
]
