"""One jitted MoE layer training step, run twice: a target for Nsight Compute.

    ncu --clock-control none --kernel-name regex:moe_ --launch-count 8 \
        --section SpeedOfLight --section WarpStateStats ... \
        python3 benchmarks/ncu_step.py --shape 7b

Builds the step of `benchmarks/step.py` (router GEMM, top-K routing, forward and backward
through `pm.moe_ffn(backend="mosaic")`) on fresh random data and runs it; ncu then profiles
each Mosaic kernel (`moe_*`) of the first step.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.forward import SHAPES
from benchmarks.step import make_step
from pallas_moe.kernels import KernelConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--routing", default="topk", choices=("topk", "token_rounding"))
    args = ap.parse_args()
    num_tokens, d, n, num_experts, _ = shape = SHAPES[args.shape]
    ks = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(ks[0], (num_tokens, d), jnp.bfloat16)
    router = jax.random.normal(ks[1], (d, num_experts), jnp.float32) * d**-0.5
    w1 = (jax.random.normal(ks[2], (num_experts, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (num_experts, n, d)) * n**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(ks[4], (num_tokens, d), jnp.float32)
    step = make_step(shape, args.routing, "mosaic", KernelConfig.for_shape(d, n))
    for _ in range(2):
        val, grads = step(x, router, w1, w2, cot)
        jax.block_until_ready(grads)
    print(f"loss {float(val):.4f}")


if __name__ == "__main__":
    main()
