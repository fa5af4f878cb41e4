import os, numpy as np, jax, jax.numpy as jnp
import pallas_moe as pm
from pallas_moe.routing import kernels
from pallas_moe.routing.plan import tile_schedule
from benchmarks.routing import gpu_us, routing_logits, PLAN_FIELDS
orig = kernels.block_tokens
rows = []
for (T, E, K) in [(16384, 512, 10), (4096, 512, 10), (16384, 256, 8), (32768, 128, 8)]:
    logits = routing_logits(T, E, K)
    want = jax.jit(lambda l: pm.routing.topk_plan(l, K))(logits)
    for bt in (None, 1, 2, 4):
        kernels.block_tokens = orig if bt is None else (lambda e, bt=bt: bt)
        f = jax.jit(lambda l: pm.routing.topk_plan(l, K))
        ft = jax.jit(lambda l: tile_schedule(pm.routing.topk_plan(l, K).group_sizes, T * K, 128))
        got = f(logits)
        eq = all(np.array_equal(np.asarray(getattr(got, n)), np.asarray(getattr(want, n))) for n in PLAN_FIELDS)
        r = (T, E, K, bt or f"default({orig(E)})", kernels.block_warps(E), eq, gpu_us(f, logits), gpu_us(ft, logits))
        rows.append(r); print(r, flush=True)
kernels.block_tokens = orig
print("| T | E | K | block_t | warps | plan equal | plan us | plan+tiles us |")
for r in rows: print("| " + " | ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in r) + " |")
