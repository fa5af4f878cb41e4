"""Pallas Mosaic GPU kernels of the MoE forward (Hopper), with pure-jnp references.

Entry points: `moe_forward(x, plan, w_gate_up, w_down, *, interpret, config)` and
`moe_backward(...)`; `KernelConfig` bundles their configs for `pm.moe_ffn(config=...)`. The
forward kernels (`up_proj`, `down_proj`, `aggregate`) are usable on their own.
`moe_decode(...)` is the forward as one persistent event-driven megakernel for small batches
(`ForwardConfig(decode=DecodeConfig(...))`; `pm.moe_ffn` with no config runs it for a single
token, where it measured faster; `docs/decode.md`).
"""

from pallas_moe.kernels.aggregate import AggregateConfig, aggregate
from pallas_moe.kernels.config import KernelConfig
from pallas_moe.kernels.decode import DecodeConfig, moe_decode
from pallas_moe.kernels.moe_backward import BackwardConfig, moe_backward
from pallas_moe.kernels.down_proj import down_proj
from pallas_moe.kernels.dx import dx_rows
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
from pallas_moe.kernels.moe_forward import ForwardConfig, moe_forward
from pallas_moe.kernels.up_proj import UpProjConfig, up_proj

__all__ = [
    "KernelConfig",
    "moe_forward", "ForwardConfig",
    "moe_decode", "DecodeConfig",
    "moe_backward", "BackwardConfig",
    "up_proj", "UpProjConfig",
    "grouped_matmul", "GroupedMatmulConfig", "down_proj", "dx_rows",
    "aggregate", "AggregateConfig",
]
