"""Ops: `moe_ffn` and its backends; `SwiGLU`, the expert activation spec every backend takes."""

from pallas_moe.ops.activation import SwiGLU

__all__ = ["SwiGLU"]
