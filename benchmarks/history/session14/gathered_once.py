"""Session 14: one call of the gathered SmoothQuant kernel at a shape, for Nsight Compute.

    ncu -k regex:gathered --launch-skip 1 --launch-count 1 python3 \\
        benchmarks/history/session14/gathered_once.py 7b [parts]
"""
import sys

import jax
import jax.numpy as jnp

from pallas_moe.quant.gathered import GatheredQuantConfig, quantize_gathered_rows
from pallas_moe.routing import topk_plan

SHAPES = {"7b": (24576, 1536, 128, 8), "30b": (32768, 4096, 128, 8)}

name = sys.argv[1] if len(sys.argv) > 1 else "7b"
T, d, E, K = SHAPES[name]
over = {"parts": int(sys.argv[2])} if len(sys.argv) > 2 else {}
ks = jax.random.split(jax.random.key(0), 4)
plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E), jnp.float32))
x = jax.random.normal(ks[2], (T, d), jnp.float32).astype(jnp.bfloat16)
smooth = jax.random.uniform(ks[3], (E, d), jnp.float32, 0.1, 4.0)
cfg = GatheredQuantConfig.for_width(d, **over)
f = jax.jit(lambda x, s, t, g, n: quantize_gathered_rows(
    x, s, t, g, n, num_out_rows=plan.capacity, out_dtype=jnp.float8_e4m3fn, config=cfg))
args = (x, smooth, plan.token_ids, plan.group_sizes, plan.num_rows)
for _ in range(2):
    jax.block_until_ready(f(*args))
print("done", cfg, flush=True)
