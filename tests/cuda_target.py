"""Lowering for a Hopper GPU from this CPU host: JAX's abstract-device mechanism names the
ahead-of-time target, which Pallas's Triton lowering and `pm.moe_ffn`'s device check read."""

import jax
from jax._src.mesh import AbstractDevice

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def h100_target():
    """Context manager: trace and lower as if for one H100 (`lowering_platforms=("cuda",)`)."""
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100))
