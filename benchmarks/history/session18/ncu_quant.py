"""The SmoothQuant CSR kernel on the benchmark's 30B (or 7B) case, twice: a target for
Nsight Compute (`ncu --kernel-name regex:moe_smoothquant ...`).

    PYTHONPATH=. python3 benchmarks/history/session18/ncu_quant.py 30b e4m3 2
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.quant import kernel_args, make_case  # noqa: E402
from pallas_moe.quant import SmoothQuantConfig, smoothquant_kernel  # noqa: E402

SHAPES = {"7b": (24576, 1536, 128, 8), "30b": (32768, 4096, 128, 8)}
name, dt, block_t = sys.argv[1], sys.argv[2], int(sys.argv[3])
out_dtype = {"e4m3": jnp.float8_e4m3fn, "int8": jnp.int8}[dt]
x, smooth, plan = make_case(SHAPES[name], "topk", seed=11)
meta = jax.jit(kernel_args)(plan)
f = jax.jit(lambda *a: smoothquant_kernel(*a, num_out_rows=plan.capacity, out_dtype=out_dtype,
                                          config=SmoothQuantConfig(block_t=block_t)))
for _ in range(2):
    jax.block_until_ready(f(x, smooth, *meta))
