"""Session 29: runs the decode megakernel (Qwen3-30B-A3B widths, the default static config)
untimed, for Nsight Compute (`ncu --kernel-name regex:moe_decode --launch-skip 1`).

    PYTHONPATH=. python3 benchmarks/history/session29/decode_run.py [T] [calls]
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
import pallas_moe as pm  # noqa: E402
from pallas_moe.kernels import DecodeConfig, moe_decode  # noqa: E402

D, N, E, K = 2048, 768, 128, 8


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    ks = jax.random.split(jax.random.key(T), 4)
    x = jax.random.normal(ks[0], (T, D), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[1], (T, E), jnp.float32)
    w1 = (jax.random.normal(ks[2], (E, D, 2 * N)) * D**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (E, N, D)) * N**-0.5).astype(jnp.bfloat16)
    config = DecodeConfig.for_shape(D, N)
    f = jax.jit(lambda l, x, w1, w2: moe_decode(x, pm.routing.topk_plan(l, K), w1, w2,
                                                config=config)[0])
    for _ in range(calls):
        out = jax.block_until_ready(f(logits, x, w1, w2))
    print(f"T={T}: {calls} calls, out finite: {bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))}")


if __name__ == "__main__":
    main()
