"""pallas-moe: Mixture-of-Experts layers for JAX with Pallas Mosaic GPU kernels for Hopper."""

from pallas_moe import _kernel_dedup, ops, routing
from pallas_moe.numerics import Numerics
from pallas_moe.ops.moe_ffn import moe_ffn

# Identical Mosaic GPU kernels (a model's repeated MoE layers) compile once (`_kernel_dedup`).
_kernel_dedup.install()

__version__ = "0.1.0"
__all__ = ["routing", "moe_ffn", "Numerics", "ops", "nn", "quant"]


def __getattr__(name):
    # flax (nn) and the Pallas quantization kernel (quant) are imported only when used.
    if name in ("nn", "quant"):
        import importlib

        return importlib.import_module(f"pallas_moe.{name}")
    raise AttributeError(f"module 'pallas_moe' has no attribute {name!r}")
