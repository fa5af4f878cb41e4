"""The W8A8 int8 forward against the fp8 one and the bf16 kernels' inference forward, 7B
shape, same run, H100 (CUPTI GPU time, per-token recipe: no smooth scales).

    PYTHONPATH=. python3 benchmarks/history/session18/int8_forward.py
"""
import functools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.forward import gpu_time_ms  # noqa: E402
import pallas_moe as pm  # noqa: E402
from tests.test_kernels_common import random_weights  # noqa: E402

T, d, n, E, K = 24576, 1536, 256, 128, 8
ks = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(ks[0], (T, d)).astype(jnp.bfloat16)
plan = jax.jit(lambda l: pm.routing.topk_plan(l, K))(jax.random.normal(ks[1], (T, E)))
w1, w2 = random_weights(ks[2], E, d, n)
bf16 = jax.jit(lambda x, p, a, b: pm.moe_ffn(x, p, a, b, backend="mosaic"))
t_bf16 = gpu_time_ms(bf16, x, plan, w1, w2, iters=10)
want = bf16(x, plan, w1, w2)
for dtype in (jnp.float8_e4m3fn, jnp.int8):
    experts = pm.quant.quantize_experts(w1, w2, dtype=dtype)
    f = jax.jit(functools.partial(pm.quant.moe_ffn_fp8, backend="mosaic"))
    t = gpu_time_ms(f, x, plan, experts, iters=10)
    got = f(x, plan, experts)
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    print(f"| 7B | {jnp.dtype(dtype).name} | {t * 1e3:.1f} us | bf16 {t_bf16 * 1e3:.1f} us | "
          f"speed-up {t_bf16 / t:.3f} | rel err vs bf16 kernels {err:.4f} |", flush=True)
