"""The building block `overlap="signal"` would stand on (docs/ep_overlap.md, section 6).

One kernel stores a block into a peer device's output and raises that peer's semaphore.
`tests/ep_check.py` lowers it on 8 CPU devices, `tests/test_signal_prerequisites.py` pins
what JAX 0.11.2 does with it on one device and in interpret mode, and
`tests/gpu_signal_probe.py` runs it on one GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def send_block(y, peer, *, remote=True):
    """Stores `y` into device `peer`'s output and signals it; returns this device's output.

    Call inside a `shard_map` (the peer is a mesh index along its one axis). The kernel
    copies `y` to shared memory, TMA-stores it into `plgpu.remote_ref(out, peer)`, raises
    `peer`'s global semaphore (`pl.semaphore_signal(..., device_id=peer)`) and waits until
    its own semaphore is 1, i.e. until the block sent to it has landed. `remote=False` is
    the same kernel with a local store and a local signal (no peer addressing).

    Args:
      y: bf16[rows, width], rows and width multiples of 64.
      peer: int32[1], the destination's index along the mesh axis.

    Returns:
      bf16[rows, width]: the block some device sent here (with a permutation of peers, the
      one from the device whose `peer` is this one).
    """
    rows, width = y.shape

    def body(y_ref, peer_ref, out_ref, smem):
        arrived = pl.get_global(plgpu.SemaphoreType.REGULAR)
        dest = peer_ref[0]
        smem[...] = y_ref[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, plgpu.remote_ref(out_ref, dest) if remote else out_ref)
        plgpu.wait_smem_to_gmem(0)
        if remote:
            pl.semaphore_signal(arrived, device_id=dest)
        else:
            pl.semaphore_signal(arrived)
        pl.semaphore_wait(arrived, value=1, decrement=False)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows, width), jnp.bfloat16),
        scratch_types=[plgpu.SMEM((rows, width), jnp.bfloat16)],
    )(y, peer)
