"""Issue 9: why XLA sums x's two gradients in a separate `wrapped_add` (0.08 ms at 7B,
0.26 ms at 30B) instead of folding it into the router's dx GEMM as cuBLAS's C operand.
Compiles the default step for the GPU and prints the optimized HLO around every
[T, d] add and every cuBLAS call that makes a [T, d] result.
Usage: PYTHONPATH=. python3 benchmarks/history/session60/hlo_add.py 7b [OUT]"""
import os
import re
import sys

import jax

from benchmarks.forward import SHAPES
from benchmarks.step import make_step, step_inputs
from pallas_moe.kernels import KernelConfig

name = sys.argv[1] if len(sys.argv) > 1 else "7b"
out = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", ".")
shape = SHAPES[name]
T, d, n, E, K = shape
x, router, w1, w2, cot = step_inputs(shape, 0)
config = KernelConfig.for_shape(d, n, gather="cp_async")
step = make_step(shape, "topk", "mosaic", config)
text = step.lower(x, router, w1, w2, cot.astype(jax.numpy.bfloat16)).compile().as_text()
with open(os.path.join(out, f"step_{name}_hlo.txt"), "w") as f:
    f.write(text)
td = f"[{T},{d}]"
lines = text.splitlines()
for i, line in enumerate(lines):
    if td in line and (re.search(r"\badd\(|wrapped_add|__cublas|gemm", line)):
        print(f"{i}: {line.strip()[:400]}")
