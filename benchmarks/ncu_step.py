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
from benchmarks.step import make_step, step_inputs
from pallas_moe.kernels import KernelConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--routing", default="topk", choices=("topk", "token_rounding"))
    args = ap.parse_args()
    _, d, n, _, _ = shape = SHAPES[args.shape]
    x, router, w1, w2, cot = step_inputs(shape, seed=1)
    step = make_step(shape, args.routing, "mosaic", KernelConfig.for_shape(d, n))
    for _ in range(2):
        out, grads = step(x, router, w1, w2, cot.astype(jnp.bfloat16))  # the vjp harness
        jax.block_until_ready(grads)
    print(f"output norm {float(jnp.linalg.norm(out.astype(jnp.float32))):.4f}")


if __name__ == "__main__":
    main()
