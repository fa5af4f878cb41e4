"""Session 26: the SmoothQuant CSR kernel (default config, smoothed, top-K over random
logits) run untimed as a target for Nsight Compute: 7B e4m3, then 30B e4m3, then 30B int8,
each twice.

    PYTHONPATH=. python3 benchmarks/history/session26/quant_run.py
"""
import jax
import jax.numpy as jnp

from benchmarks.quant import kernel_args, make_case
from pallas_moe.quant.kernel import smoothquant_kernel

SHAPES = {"7b": (24576, 1536, 128, 8), "30b": (32768, 4096, 128, 8)}

for name, out_dtype in (("7b", jnp.float8_e4m3fn), ("30b", jnp.float8_e4m3fn), ("30b", jnp.int8)):
    x, smooth, plan = make_case(SHAPES[name], "topk", seed=11)
    meta = jax.jit(kernel_args)(plan)
    f = jax.jit(lambda i, s, a0, a1, a2, a3, od=out_dtype, p=plan.capacity: smoothquant_kernel(
        i, s, a0, a1, a2, a3, num_out_rows=p, out_dtype=od))
    for _ in range(2):
        jax.block_until_ready(f(x, smooth, *meta))
    print(name, jnp.dtype(out_dtype).name, "ran", flush=True)
