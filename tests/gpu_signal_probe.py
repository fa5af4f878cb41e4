"""What one GPU does with the kernel `overlap="signal"` would stand on (a script, not a test).

    PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 600 python3 tests/gpu_signal_probe.py

Runs `tests/remote_block_kernel.send_block` on a 1-device mesh, each variant in its own
process (a variant can abort the process or hang in `semaphore_wait`), and prints one JSON
line per variant: `status` ("ok": ran and the block arrived bitwise; "wrong": ran, wrong
block; "error": raised or aborted; "timeout"), the exit code and the end of its stderr.

- `local`: local TMA store, local semaphore. The control: the kernel itself runs.
- `remote_self`: `plgpu.remote_ref(out, self)` and `pl.semaphore_signal(..., device_id=self)`.
  On a 1-device mesh these lower to NVSHMEM calls (`tests/test_signal_prerequisites.py`);
  docs/ep_overlap.md section 6 expects an error here, because XLA never initializes NVSHMEM.
- `remote_self_nvshmem_flag`: the same with `--xla_gpu_experimental_enable_nvshmem` in
  XLA_FLAGS, which Mosaic GPU requires for NVSHMEM; jaxlib 0.11.2 rejects the flag on the
  CPU, and the doc expects the same abort here.

If `remote_self` prints "ok", a single-GPU test of the signalling kernel is possible after
all: record it in docs/ep_overlap.md section 6. Expected runtime: under 2 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

VARIANTS = ("local", "remote_self", "remote_self_nvshmem_flag")
TIMEOUT_S = 180


def run_variant(variant: str) -> None:
    """The child process: one variant, exit 0 when the block arrived bitwise, 3 when not."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as Spec

    sys.path.insert(0, os.getcwd())
    from tests.remote_block_kernel import send_block

    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    remote = variant != "local"

    def step(y):
        return send_block(y, jax.lax.axis_index("expert").astype(jnp.int32).reshape(1), remote=remote)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=Spec("expert"), out_specs=Spec("expert"), check_vma=False))
    # Fresh random data every run; the kernel's output buffer is fresh too, so an unwritten
    # block would show as a mismatch, not as a lucky zero.
    seed = int.from_bytes(os.urandom(4), "little")
    y = jax.random.normal(jax.random.key(seed), (128, 256), jnp.float32).astype(jnp.bfloat16)
    out = np.asarray(jax.block_until_ready(fn(y)))
    same = bool(np.array_equal(out.view(np.uint16), np.asarray(y).view(np.uint16)))
    print(json.dumps({"variant": variant, "device": jax.devices()[0].device_kind, "arrived": same}), flush=True)
    sys.exit(0 if same else 3)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        run_variant(sys.argv[2])
        return 0
    for variant in VARIANTS:
        env = dict(os.environ)
        if variant == "remote_self_nvshmem_flag":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_experimental_enable_nvshmem").strip()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--variant", variant],
                env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as err:
            tail = (err.stderr or b"")[-1500:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            print(json.dumps({"variant": variant, "status": "timeout", "stderr_tail": tail}), flush=True)
            continue
        status = {0: "ok", 3: "wrong"}.get(proc.returncode, "error")
        print(json.dumps({
            "variant": variant, "status": status, "rc": proc.returncode,
            "stdout": proc.stdout.strip()[-500:], "stderr_tail": proc.stderr.strip()[-1500:],
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
