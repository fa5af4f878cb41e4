"""pallas-moe: Mixture-of-Experts layers for JAX with Pallas Mosaic GPU kernels for Hopper."""

from pallas_moe import routing
from pallas_moe.numerics import Numerics
from pallas_moe.ops.moe_ffn import moe_ffn

__version__ = "0.1.0"
__all__ = ["routing", "moe_ffn", "Numerics", "nn"]


def __getattr__(name):
    # flax is imported only when the module API is used.
    if name == "nn":
        import importlib

        return importlib.import_module("pallas_moe.nn")
    raise AttributeError(f"module 'pallas_moe' has no attribute {name!r}")
