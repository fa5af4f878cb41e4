"""Session 33 (issue 13): the SmoothQuant CSR kernel run untimed as an Nsight Compute
target, at the default config or with `x_per_row=True`: 7B e4m3, then 30B e4m3, each twice
(launches 0-1 and 2-3).

    PYTHONPATH=. python3 benchmarks/history/session33/quant_run.py [default|x_per_row]
"""
import sys

import jax
import jax.numpy as jnp

from benchmarks.quant import SHAPES, kernel_args, make_case
from pallas_moe.quant import SmoothQuantConfig
from pallas_moe.quant.kernel import smoothquant_kernel

config = SmoothQuantConfig(x_per_row=(sys.argv[1:] == ["x_per_row"]))
for name in ("7b", "30b"):
    x, smooth, plan = make_case(SHAPES[name], "topk", seed=11)
    meta = jax.jit(kernel_args)(plan)
    f = jax.jit(lambda i, s, a0, a1, a2, a3, p=plan.capacity: smoothquant_kernel(
        i, s, a0, a1, a2, a3, num_out_rows=p, out_dtype=jnp.float8_e4m3fn, config=config))
    for _ in range(2):
        jax.block_until_ready(f(x, smooth, *meta))
    print(name, config, "ran", flush=True)
