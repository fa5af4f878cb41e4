"""Where one MoE layer's step time goes under top-K vs token rounding.

    python -m train.bench_routing                                   # 7B layer shape at T=8192
    python -m train.bench_routing --tokens 24576 --backend xla

Times, for one layer under `jax.jit` (median of `--iters` runs):
  route     router logits + plan (the top-K or token-rounding routing itself)
  forward   route + `pm.moe_ffn`
  fwd+bwd   forward and its gradient w.r.t. x, router and both expert weights
It also prints the plan capacity and the real rows. The routing's cost and the capacity's
cost are what token rounding has to win back from the padding it removes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import pallas_moe as pm
from pallas_moe.nn import functional as F


def timed(fn, *args, iters: int) -> float:
    """Median wall milliseconds of a jitted call (after one warm-up call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.bench_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d", type=int, default=1536)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--tile", type=int, default=128)
    p.add_argument("--skew", type=float, default=1.0, help="std of a per-expert logit offset (load imbalance)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)

    t, d, n, e, k = args.tokens, args.d, args.n, args.experts, args.k
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, d), jnp.float32).astype(dtype)  # [T, d]
    router = jax.random.normal(keys[1], (d, e), jnp.float32) * d**-0.5  # [d, E]
    w1 = (jax.random.normal(keys[2], (e, d, 2 * n), jnp.float32) * d**-0.5).astype(dtype)  # [E, d, 2n]
    w2 = (jax.random.normal(keys[3], (e, n, d), jnp.float32) * n**-0.5).astype(dtype)  # [E, n, d]
    offset = args.skew * jax.random.normal(keys[4], (e,), jnp.float32)  # [E] popularity skew

    print(f"T={t} d={d} n={n} E={e} K={k} tile={args.tile} (T*K/E/tile={t * k / e / args.tile:.2f}) "
          f"skew={args.skew} backend={args.backend} dtype={dtype.name} on {jax.devices()[0]}", flush=True)
    print(f"{'routing':>15} {'capacity':>9} {'rows':>7} {'pad(top-K)':>10} {'route ms':>9} {'forward ms':>10} {'fwd+bwd ms':>10}")
    for routing in ("topk", "token_rounding"):
        cfg = F.RouterConfig(num_experts=e, top_k=k, routing=routing, tile=args.tile)

        def route(x, router):
            logits = F.router_logits(x, router) + offset[None, :]  # f32[T, E]
            return F.route(logits, cfg)[0]

        def forward(x, router, w1, w2):
            plan = route(x, router)
            return pm.moe_ffn(x, plan, w1, w2, backend=args.backend)  # [T, d]

        def loss(x, router, w1, w2):
            return jnp.sum(forward(x, router, w1, w2).astype(jnp.float32) ** 2)

        route_j = jax.jit(route)
        plan = route_j(x, router)
        rows = int(plan.num_rows)
        counts = plan.group_sizes
        tc_pad = int(jnp.sum(-(-counts // args.tile) * args.tile - counts)) if routing == "topk" else None
        ms_route = timed(route_j, x, router, iters=args.iters)
        ms_fwd = timed(jax.jit(forward), x, router, w1, w2, iters=args.iters)
        ms_bwd = timed(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), x, router, w1, w2, iters=args.iters)
        pad = "-" if tc_pad is None else f"{100 * tc_pad / (rows + tc_pad):.1f}%"
        print(f"{routing:>15} {plan.capacity:>9} {rows:>7} {pad:>10} {ms_route:>9.3f} {ms_fwd:>10.3f} {ms_bwd:>10.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
