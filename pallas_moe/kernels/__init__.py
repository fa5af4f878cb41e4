"""Pallas Mosaic GPU kernels of the MoE forward (Hopper), with pure-jnp references.

Entry point: `moe_forward(x, plan, w_gate_up, w_down, *, interpret, config)`; the three
kernels (`up_proj`, `down_proj`, `aggregate`) are usable on their own.
"""

from pallas_moe.kernels.aggregate import AggregateConfig, aggregate
from pallas_moe.kernels.down_proj import DownProjConfig, down_proj
from pallas_moe.kernels.moe_forward import ForwardConfig, moe_forward
from pallas_moe.kernels.up_proj import UpProjConfig, up_proj

__all__ = [
    "moe_forward", "ForwardConfig",
    "up_proj", "UpProjConfig",
    "down_proj", "DownProjConfig",
    "aggregate", "AggregateConfig",
]
