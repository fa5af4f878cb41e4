"""Why `ExpertParallel(overlap="signal")` is not built: the facts docs/ep_overlap.md (section 6)
rests on, as JAX 0.11.2 shows them on one CPU device.

The signalling down-proj needs a kernel that stores rows into a peer's buffer and raises
the peer's semaphore. For it to be built here, it has to be testable in interpret mode on
the CPU and on one GPU (a 1-device mesh that sends to itself). Each test below pins one
reason it is not. When one of them fails after a JAX upgrade, the reason is gone: revisit
`overlap="signal"` and the doc. (`tests/test_expert_parallel.py::test_bad_overlap` checks the
refusal itself.)
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as Spec

from pallas_moe.kernels._common import interpret_params
from tests.remote_block_kernel import send_block

# JAX exports no public name for resetting Mosaic GPU's interpret state after a failed kernel.
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpret  # noqa: E402

ROWS, WIDTH = 64, 128


def _one_device(fn):
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=Spec("expert"), out_specs=Spec("expert"), check_vma=False))


def _cuda_text(remote):
    def step(y):
        return send_block(y, jax.lax.axis_index("expert").astype(jnp.int32).reshape(1), remote=remote)

    return _one_device(step).trace(jnp.ones((ROWS, WIDTH), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()


def test_one_device_mesh_sends_through_nvshmem():
    """On a 1-device mesh, `remote_ref` and a remote `semaphore_signal` lower to NVSHMEM calls
    (`nvshmem_ptr`, `nvshmem_my_pe`), not to XLA's collective metadata, which Mosaic GPU uses
    only for meshes of 2+ devices in one process (`launch_context.py`, `num_peers <= 1`).
    So send-to-self on one GPU needs NVSHMEM (see `test_nvshmem_flag_rejected`). The same
    kernel with a local store and signal needs neither."""
    remote = _cuda_text(remote=True)
    assert "nvshmem_ptr" in remote and "nvshmem_my_pe" in remote
    assert "uses_xla_collective_metadata = false" in remote
    assert "nvshmem" not in _cuda_text(remote=False)


def test_nvshmem_flag_rejected():
    """Mosaic GPU turns NVSHMEM on only when XLA_FLAGS holds
    `--xla_gpu_experimental_enable_nvshmem` (`jax.experimental.mosaic.gpu.core.is_nvshmem_available`),
    and jaxlib 0.11.2's flag parser aborts the process on that flag. (The GPU image runs the
    same jaxlib; the CUDA plugin knows the flag but the host parser reads XLA_FLAGS first.)"""
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_experimental_enable_nvshmem", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "Unknown flag in XLA_FLAGS: --xla_gpu_experimental_enable_nvshmem" in proc.stderr


def _interpret_call(kernel, scratch_shapes=()):
    def body(x):
        return pl.pallas_call(
            kernel,
            in_specs=[pl.BlockSpec(memory_space=plgpu.GMEM)],
            out_specs=pl.BlockSpec(memory_space=plgpu.GMEM),
            out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            scratch_shapes=list(scratch_shapes),
            interpret=interpret_params(True),
        )(x)

    return _one_device(body)


def test_interpret_mode_has_no_remote_refs_or_semaphores():
    """Mosaic GPU's interpret mode in JAX 0.11.2 runs none of the three primitives."""
    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)

    def remote_store(x_ref, y_ref):
        plgpu.remote_ref(y_ref, jax.lax.axis_index("expert"))[...] = x_ref[...]

    try:  # the store's callback refuses the PeerMemRef transform (gpu_callbacks._validate_transforms)
        with pytest.raises(Exception, match="Unsupported transform: PeerMemRef"):
            jax.block_until_ready(_interpret_call(remote_store)(x))
    finally:
        mgpu_interpret.reset_gpu_interpret_mode_state()

    def local_signal(x_ref, y_ref, sem):
        y_ref[...] = x_ref[...]
        pl.semaphore_signal(sem)
        pl.semaphore_wait(sem)

    # A semaphore in scratch: interpret_pallas_call._get_kernel_buffers has no case for it
    # ("TODO(nrink): Support allocation of semaphores.") and fails its GMEM assertion.
    with pytest.raises(AssertionError):
        _interpret_call(local_signal, [plgpu.SemaphoreType.REGULAR])(x)

    def global_signal(x_ref, y_ref):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        y_ref[...] = x_ref[...]
        pl.semaphore_signal(sem)
        pl.semaphore_wait(sem)

    def kernel_body(x):
        return plgpu.kernel(
            global_signal, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32),
            interpret=interpret_params(True),
        )(x)

    # A global semaphore (what collective kernels use): the interpreter cannot lower its ref.
    with pytest.raises(TypeError, match="No ir_type_handler for aval type"):
        _one_device(kernel_body)(x)
