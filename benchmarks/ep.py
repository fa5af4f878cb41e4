"""Expert parallelism on GPUs: EP vs single-device correctness, and layer timing.

    # on the 2xH200 machine, from the repo root:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/ep.py --backend mosaic
    # quick CPU smoke run of the script itself:
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python benchmarks/ep.py \
        --backend xla --shape 256,64,32,8,2 --check-shape 64,32,16,4,2 --dispatch all_gather,emulated_ragged_all_to_all

1. Correctness: the same `pm.nn.MoE` (same init) run on one device and with
   `ExpertParallel(mesh, dispatch=...)` on EP GPUs, at `--check-shape`: outputs and the
   gradients of every parameter and of x must agree (relative Frobenius error below
   `--tol`; bf16 summation order differs).
2. Timing: jitted layer forward, and forward+backward (value_and_grad w.r.t. all parameters
   and x), at `--shape` (default the 30B shape T=32768, d=4096, n=512, E=128, K=8),
   for EP=1 (one GPU, no expert parallelism) and each EP size and dispatch. Tokens are
   sharded over the EP devices (global batch T); weights live sharded over the expert axis.
   Median of `--iters` runs after warm-up. Prints a table and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_moe as pm
from pallas_moe.ops.moe_ffn import BACKENDS


@dataclasses.dataclass(frozen=True)
class Shape:
    T: int
    d: int
    n: int
    E: int
    K: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        return cls(*(int(v) for v in text.split(",")))

    @property
    def flops_fwd(self) -> float:
        return 6.0 * self.T * self.K * self.n * self.d


def build(shape: Shape, args, ep=None):
    return pm.nn.MoE(
        shape.d, shape.n, shape.E, shape.K, routing=args.routing, tile=args.tile,
        backend=args.backend, dtype=jnp.bfloat16, param_dtype=args.param_dtype,
        rngs=nnx.Rngs(0), expert_parallel=ep,
    )


def tokens(shape: Shape, skew: bool):
    x = jax.random.normal(jax.random.key(1), (shape.T, shape.d), jnp.float32)
    if skew:
        x = x.at[:, 0].set(4.0)
    return x.astype(jnp.bfloat16)


def skew_router(layer, shape: Shape):
    # With x[:, 0] = 4, this makes the later experts much more popular.
    layer.router[0, :] = jnp.linspace(-0.5, 0.5, shape.E).astype(layer.router[...].dtype)


def step_fns(layer):
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return 0.5 * jnp.mean(jnp.square(y.astype(jnp.float32))) + aux["loss"]

    def forward(params, x):
        return nnx.merge(graphdef, params, rest)(x)[0]

    return params, jax.jit(forward), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def place(params, x, mesh, ep_axis):
    """Weights sharded over the expert axis, other params replicated, tokens over all axes."""
    if mesh is None:
        device = jax.devices()[0]
        return jax.device_put(params, device), jax.device_put(x, device)

    def spec(path, leaf):
        name = jax.tree_util.keystr(path)
        if "w_gate_up" in name or "w_down" in name:
            return NamedSharding(mesh, P(ep_axis))
        return NamedSharding(mesh, P())

    params = jax.tree_util.tree_map_with_path(lambda p, a: jax.device_put(a, spec(p, a)), params)
    return params, jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))


def time_fn(fn, *args, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_mesh(ep_size: int):
    devices = np.array(jax.devices()[:ep_size])
    return Mesh(devices.reshape(1, ep_size), ("data", "expert"))


def make_ep(ep_size: int, dispatch: str, args):
    capacity = None if dispatch == "all_gather" else args.capacity_factor
    return pm.nn.ExpertParallel(make_mesh(ep_size), dispatch=dispatch, capacity_factor=capacity)


def check(shape: Shape, ep_size: int, dispatch: str, args) -> dict:
    """EP vs single-device outputs and gradients at a small shape."""
    x = tokens(shape, args.skew)
    results = {}
    for name, ep in (("single", None), ("ep", make_ep(ep_size, dispatch, args))):
        layer = build(shape, args, ep)
        if args.skew:
            skew_router(layer, shape)
        params, forward, grad = step_fns(layer)
        params, xs = place(params, x, None if ep is None else ep.mesh, "expert")
        (loss, (g_params, g_x)) = grad(params, xs)
        results[name] = (forward(params, xs), loss, g_params, g_x)
    (y0, l0, gp0, gx0), (y1, l1, gp1, gx1) = results["single"], results["ep"]
    grad_errs = {
        jax.tree_util.keystr(p): rel_err(b, a)
        for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(gp0), jax.tree.leaves(gp1))
    }
    out = {
        "ep": ep_size, "dispatch": dispatch,
        "y_rel_err": rel_err(y1, y0), "loss_rel_err": rel_err(l1, l0),
        "dx_rel_err": rel_err(gx1, gx0), "dparams_rel_err": grad_errs,
    }
    worst = max(out["y_rel_err"], out["dx_rel_err"], *grad_errs.values())
    out["ok"] = bool(worst < args.tol)
    return out


def bench(shape: Shape, ep_size: int, dispatch: str | None, args) -> dict:
    ep = None if dispatch is None else make_ep(ep_size, dispatch, args)
    layer = build(shape, args, ep)
    if args.skew:
        skew_router(layer, shape)
    params, forward, grad = step_fns(layer)
    params, x = place(params, tokens(shape, args.skew), None if ep is None else ep.mesh, "expert")
    t_fwd = time_fn(forward, params, x, iters=args.iters)
    t_fb = time_fn(grad, params, x, iters=args.iters)
    flops = shape.flops_fwd
    return {
        "ep": ep_size, "dispatch": dispatch or "-",
        "fwd_ms": 1e3 * t_fwd, "fwd_bwd_ms": 1e3 * t_fb,
        # Model FLOPs per device (docs/math.md: 6PTnd forward, 18PTnd forward+backward).
        "fwd_bwd_tflops_per_gpu": 3 * flops / t_fb / 1e12 / ep_size,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mosaic", choices=BACKENDS)
    parser.add_argument("--shape", default="32768,4096,512,128,8", help="T,d,n,E,K (global T)")
    parser.add_argument("--check-shape", default="4096,1024,256,16,4", help="T,d,n,E,K of the correctness check")
    parser.add_argument("--ep", default="2", help="comma-separated EP sizes to time besides EP=1")
    parser.add_argument("--dispatch", default="all_gather,ragged_all_to_all")
    parser.add_argument("--routing", default="topk", choices=("topk", "token_rounding"))
    parser.add_argument("--tile", type=int, default=128)
    parser.add_argument("--param-dtype", default="bfloat16", dest="param_dtype")
    parser.add_argument("--skew", action="store_true", help="skewed routing")
    parser.add_argument("--capacity-factor", type=float, default=None, dest="capacity_factor",
                        help="ragged dispatch receive buffer, x T_l*K rows (default: exact worst case)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tol", type=float, default=2e-2)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--out", default=None, help="markdown table path (default benchmarks/results/ep_<device>.md)")
    args = parser.parse_args(argv)
    args.param_dtype = jnp.dtype(args.param_dtype)
    ep_sizes = [int(v) for v in args.ep.split(",") if v]
    dispatches = [v for v in args.dispatch.split(",") if v]
    device = jax.devices()[0]
    print(f"devices: {len(jax.devices())} x {device.device_kind}; backend={args.backend}", flush=True)
    if max(ep_sizes) > len(jax.devices()):
        print(f"need {max(ep_sizes)} devices, have {len(jax.devices())}", file=sys.stderr)
        return 2

    failed = False
    checks = []
    if not args.skip_check:
        shape = Shape.parse(args.check_shape)
        for ep_size in ep_sizes:
            for dispatch in dispatches:
                result = check(shape, ep_size, dispatch, args)
                checks.append(result)
                failed |= not result["ok"]
                print("check", json.dumps(result), flush=True)

    rows = []
    if not args.skip_bench:
        shape = Shape.parse(args.shape)
        configs = [(1, None)] + [(e, d) for e in ep_sizes for d in dispatches]
        for ep_size, dispatch in configs:
            try:
                row = bench(shape, ep_size, dispatch, args)
            except Exception as err:  # report and go on: one failing config must not hide the rest
                row = {"ep": ep_size, "dispatch": dispatch or "-", "error": f"{type(err).__name__}: {err}"[:300]}
                failed = True
            rows.append(row)
            print("bench", json.dumps(row), flush=True)

    shape = Shape.parse(args.shape)
    lines = [
        f"# EP layer benchmark: {len(jax.devices())} x {device.device_kind}, backend={args.backend}, "
        f"routing={args.routing}{' (skewed)' if args.skew else ''}",
        "",
        f"Shape T={shape.T} (global), d={shape.d}, n={shape.n}, E={shape.E}, K={shape.K}; bf16 compute, "
        f"params {args.param_dtype.name}; median of {args.iters}.",
        "",
        "| EP | dispatch | forward ms | fwd+bwd ms | fwd+bwd TFLOP/s per GPU |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['ep']} | {row['dispatch']} | error | {row['error']} | |")
        else:
            lines.append(
                f"| {row['ep']} | {row['dispatch']} | {row['fwd_ms']:.2f} | {row['fwd_bwd_ms']:.2f} | "
                f"{row['fwd_bwd_tflops_per_gpu']:.0f} |"
            )
    if checks:
        lines += ["", f"Correctness at {args.check_shape} (T,d,n,E,K), relative error vs one device:", ""]
        for c in checks:
            worst_grad = max(c["dparams_rel_err"].values())
            lines.append(
                f"- EP={c['ep']} {c['dispatch']}: y {c['y_rel_err']:.1e}, dx {c['dx_rel_err']:.1e}, "
                f"worst dparam {worst_grad:.1e} -> {'ok' if c['ok'] else 'FAIL'}"
            )
    table = "\n".join(lines) + "\n"
    print(table)
    out = args.out or os.path.join(
        "benchmarks", "results", f"ep_{device.device_kind.replace(' ', '_')}_{args.backend}.md"
    )
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
