"""Expert parallelism on GPUs: correctness, weak and strong scaling, overlap timing.

    # on a multi-GPU machine (here 8 GPUs), from the repo root; one command runs it all:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/ep.py --backend mosaic --ep 2,4,8
    # quick CPU smoke run of the script itself:
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python benchmarks/ep.py \
        --backend xla --ep 2 --shape 256,64,32,8,2 --check-shape 64,32,16,4,2 --weak-tokens 128 \
        --dispatch all_gather,emulated_ragged_all_to_all --iters 2

1. Correctness (`--check-shape`): the same `pm.nn.MoE` (same init) on one device and with
   `ExpertParallel(mesh, dispatch=..., overlap=...)` on EP GPUs, for every EP size, both
   dispatches, "none" and "chunked" overlap (rows or tokens in chunks), top-K and token
   rounding, random and skewed routing: outputs and the gradients of every parameter and
   of x must agree (relative Frobenius error below `--tol`; bf16 summation order differs).
   Then the same with `check_vma=True` on the xla backend: the Pallas kernels cannot run
   under it in JAX 0.11.2 (`plgpu.kernel` rejects varying inputs), so the kernel path is
   checked with `check_vma=False` and the xla path with the type check on.
2. Strong scaling (`--shape`, default the 30B shape T=32768, d=4096, n=512, E=128, K=8):
   the same global batch on EP=1 (one GPU, no EP) and on each EP size, every dispatch and
   overlap. Weak scaling: `--weak-tokens` tokens per GPU (global T = that x EP). Jitted
   forward and forward+backward (value_and_grad w.r.t. all parameters and x), wall time,
   median of `--iters` after warm-up. Tokens are split over the EP GPUs; expert weights
   live split over the expert axis.
3. Overlap: "none" vs "chunked" (`--num-chunks`) rows of the timing tables, and, for each
   EP config, where the compiled forward schedules the overlaps
   (`pallas_moe.nn.overlap_check.ep_overlap_report`): whether the shared MLP sits between
   the dispatch's async start and done, and whether each chunk's combine starts before
   the next chunk's down-proj (the layer has one shared expert here); `--dump-hlo DIR`
   keeps each compiled forward. Each traced forward reports the collectives' GPU time and
   the part of it that ran beside the layer's kernels.

Prints tables and writes them (markdown) and the raw rows (JSON) next to `--out`. The
one-GPU cost of chunking the down-proj is `benchmarks/chunked_down_proj.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_moe as pm
from benchmarks.step import kernel_key, traced_gpu_events_by_device
from pallas_moe.nn.overlap_check import ep_overlap_report
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


def build(shape: Shape, args, ep=None, routing=None, backend=None):
    return pm.nn.MoE(
        shape.d, shape.n, shape.E, shape.K, routing=routing or args.routing, tile=args.tile,
        backend=backend or args.backend, dtype=jnp.bfloat16, param_dtype=args.param_dtype,
        num_shared_experts=args.shared_experts, rngs=nnx.Rngs(0), expert_parallel=ep,
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


def _exit_hung_turn(limit_s: float) -> None:
    print(f"error: a GPU turn ran past --turn-limit {limit_s:.0f} s; exiting so that the GPU lock "
          "is freed (a collective whose other ranks failed, e.g. out of memory, waits forever)",
          file=sys.stderr, flush=True)
    os._exit(3)


@contextlib.contextmanager
def gpu_turn(lock_path: str | None, limit_s: float | None = None, on_timeout=_exit_hung_turn):
    """Holds an exclusive file lock while the GPUs run: several ep.py processes started
    side by side (`--gpu-lock` on the same path) compile at once on the CPU but run and
    time their programs one at a time. No lock without a path.

    `limit_s`: a watchdog thread calls `on_timeout(limit_s)` (default: exit the process)
    if the turn lasts longer. In session 35 one device of an EP = 2 program ran out of
    memory, the other waited in the collective's rendezvous forever, and the process held
    the lock until every other process's time ran out."""
    if not lock_path:
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        watchdog = threading.Timer(limit_s, on_timeout, (limit_s,)) if limit_s else None
        if watchdog:
            watchdog.daemon = True
            watchdog.start()
        try:
            yield
        finally:
            if watchdog:
                watchdog.cancel()
            fcntl.flock(handle, fcntl.LOCK_UN)


# Substrings (lower case) of the GPU kernel and copy names of collectives: NCCL's kernels,
# XLA's own collective kernels and peer-to-peer copies.
COLLECTIVE_MARKERS = (
    "nccl", "all_to_all", "alltoall", "all-to-all", "allgather", "all_gather", "all-gather",
    "allreduce", "all_reduce", "all-reduce", "reducescatter", "reduce_scatter", "sendrecv",
    "ragged", "p2p", "ptop", "peer",
)


def is_collective_event(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COLLECTIVE_MARKERS)


def hidden_collective_time(events) -> list[tuple[int, int, str, int]]:
    """[(start ns, duration ns, name, hidden ns)] for each collective event of one device's
    sorted (start ns, end ns, name) trace (`is_collective_event`): `hidden` is the part of
    its duration during which some non-collective event (a kernel of the layer, on another
    stream) ran. A collective nothing runs beside is exposed: the layer waits for it."""
    compute = []  # merged [start, end] of the non-collective events
    for start, end, name in events:
        if is_collective_event(name):
            continue
        if compute and start <= compute[-1][1]:
            compute[-1][1] = max(compute[-1][1], end)
        else:
            compute.append([start, end])
    out = []
    for start, end, name in events:
        if not is_collective_event(name):
            continue
        hidden = sum(max(0, min(end, c_end) - max(start, c_start)) for c_start, c_end in compute)
        out.append((start, end - start, name, hidden))
    return out


def collective_overlap(fn, *args, steps: int) -> dict:
    """Per device, from `steps` traced calls of `fn`: collective GPU time per call, the part
    of it hidden behind the layer's kernels, and the collectives of the middle call in order
    (key, duration us, hidden us)."""
    report = {}
    for device, events in traced_gpu_events_by_device(fn, *args, steps=steps).items():
        collectives = hidden_collective_time(events)
        total = sum(c[1] for c in collectives)
        hidden = sum(c[3] for c in collectives)
        per_call = len(collectives) // steps if steps else 0
        middle = collectives[per_call * (steps // 2): per_call * (steps // 2 + 1)]
        # Every GPU event from the middle call's first collective to its last one's end
        # (start us from there, duration us, name): what ran beside each collective.
        window = (middle[0][0], max(c[0] + c[1] for c in middle)) if middle else (0, -1)
        timeline = [((s - window[0]) / 1e3, (e - s) / 1e3, kernel_key(name))
                    for s, e, name in events if window[0] <= s <= window[1]][:400]
        report[device] = {
            "collective_us": total / steps / 1e3, "hidden_us": hidden / steps / 1e3,
            "hidden_fraction": hidden / total if total else None,
            "collectives": [(kernel_key(name), dur / 1e3, hid / 1e3) for _, dur, name, hid in middle],
            "kernel_names": sorted({kernel_key(name) for _, _, name in events}),
            "timeline": timeline,
        }
    return report


def link_bandwidth_gbs(ep_size: int, megabytes: int = 512, iters: int = 10) -> float:
    """GB/s each GPU sends while every GPU of the EP group sends `megabytes` to the next one
    at the same time (`ppermute` in a ring: each link busy both ways, as in an all-to-all)."""
    mesh = make_mesh(ep_size)
    x = jax.device_put(jnp.ones((ep_size, megabytes * 2**19), jnp.bfloat16), NamedSharding(mesh, P("expert")))
    ring = [(i, (i + 1) % ep_size) for i in range(ep_size)]
    send = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, "expert", ring), mesh=mesh,
                                 in_specs=P("expert"), out_specs=P("expert")))
    return megabytes * 2**20 / time_fn(send, x, iters=iters) / 1e9


def exchange_time_ms(ep_size: int, rows: int, d: int, iters: int = 10) -> dict:
    """The ragged dispatch's collective alone: every GPU sends (G-1)/G of its `rows` bf16
    rows of width d to the others (`jax.lax.ragged_all_to_all`, uniform split, receive
    buffer `rows`), and, for reference, `jax.lax.all_to_all` of the same [rows, d] array.
    Which implementation XLA uses is set by XLA_FLAGS (one process per setting)."""
    mesh = make_mesh(ep_size)
    g = ep_size
    per = rows // g
    x = jax.device_put(jnp.ones((g * rows, d), jnp.bfloat16), NamedSharding(mesh, P("expert")))

    def ragged(a):
        offsets = jnp.arange(g, dtype=jnp.int32) * per
        sizes = jnp.full((g,), per, jnp.int32)
        me = jax.lax.axis_index("expert")
        return jax.lax.ragged_all_to_all(a, jnp.zeros_like(a), offsets, sizes,
                                         jnp.full((g,), me * per, jnp.int32), sizes, axis_name="expert")

    def dense(a):
        return jax.lax.all_to_all(a, "expert", 0, 0, tiled=True)

    out = {"ep": g, "rows": rows, "d": d, "bytes_sent_per_gpu": (g - 1) * per * d * 2}
    for name, body in (("ragged_all_to_all", ragged), ("all_to_all", dense)):
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
        try:
            out[f"{name}_ms"] = 1e3 * time_fn(fn, x, iters=iters)
        except Exception as err:  # report and go on
            out[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
    return out


def link_bytes_per_gpu(shape: Shape, ep_size: int, dispatch: str) -> float:
    """Bytes one GPU sends over the links in a forward+backward step, at uniform routing:
    four collectives (dispatch, combine, and their transposes in the backward). Ragged:
    (G-1)/G of its T_l*K routed bf16 rows each; all_gather: its T_l bf16 rows to G-1 GPUs
    (all-gather of x, reduce-scatter of y)."""
    g = ep_size
    tokens_local = shape.T // g
    rows = (g - 1) / g * tokens_local * shape.K if dispatch != "all_gather" else (g - 1) * tokens_local
    return 4 * rows * shape.d * 2


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


def make_ep(ep_size: int, dispatch: str, args, overlap: str = "none", check_vma: bool = False):
    capacity = None if dispatch == "all_gather" else args.capacity_factor
    return pm.nn.ExpertParallel(
        make_mesh(ep_size), dispatch=dispatch, capacity_factor=capacity, overlap=overlap,
        num_chunks=args.num_chunks, check_vma=check_vma,
    )


def modes(dispatches, overlaps):
    """(dispatch, overlap) pairs: every dispatch with every overlap."""
    return [(d, o) for d in dispatches for o in overlaps]


_single_cache: dict = {}


def check(shape: Shape, ep_size: int, dispatch: str, overlap: str, routing: str, skew: bool, args,
          backend=None, check_vma=False) -> dict:
    """EP vs single-device outputs and gradients at a small shape."""
    x = tokens(shape, skew)
    backend = backend or args.backend
    results = {}
    key = (shape, routing, skew, backend)
    for name, ep in (("single", None), ("ep", make_ep(ep_size, dispatch, args, overlap, check_vma))):
        if ep is None and key in _single_cache:
            results[name] = _single_cache[key]
            continue
        layer = build(shape, args, ep, routing=routing, backend=backend)
        if skew:
            skew_router(layer, shape)
        params, forward, grad = step_fns(layer)
        params, xs = place(params, x, None if ep is None else ep.mesh, "expert")
        grad, forward = (f.lower(params, xs).compile() for f in (grad, forward))
        with gpu_turn(args.gpu_lock, args.turn_limit):
            (loss, (g_params, g_x)) = grad(params, xs)
            results[name] = jax.block_until_ready((forward(params, xs), loss, g_params, g_x))
        if ep is None:
            _single_cache[key] = results[name]
    (y0, l0, gp0, gx0), (y1, l1, gp1, gx1) = results["single"], results["ep"]
    grad_errs = {
        jax.tree_util.keystr(p): rel_err(b, a)
        for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(gp0), jax.tree.leaves(gp1))
    }
    out = {
        "ep": ep_size, "dispatch": dispatch, "overlap": overlap, "routing": routing, "skew": skew,
        "backend": backend, "check_vma": check_vma,
        "y_rel_err": rel_err(y1, y0), "loss_rel_err": rel_err(l1, l0),
        "dx_rel_err": rel_err(gx1, gx0), "dparams_rel_err": grad_errs,
    }
    worst = max(out["y_rel_err"], out["dx_rel_err"], *grad_errs.values())
    out["ok"] = bool(worst < args.tol)
    return out


def bench(shape: Shape, ep_size: int, dispatch: str | None, overlap: str, args, scaling: str) -> dict:
    ep = None if dispatch is None else make_ep(ep_size, dispatch, args, overlap)
    layer = build(shape, args, ep)
    if args.skew:
        skew_router(layer, shape)
    params, forward, grad = step_fns(layer)
    params, x = place(params, tokens(shape, args.skew), None if ep is None else ep.mesh, "expert")
    row = {"scaling": scaling, "T": shape.T, "ep": ep_size, "dispatch": dispatch or "-",
           "overlap": overlap if dispatch else "-"}
    # Compiled once, before taking the GPUs (`gpu_turn`): the schedule report and the
    # timings use the same executables.
    forward, grad = (f.lower(params, x).compile() for f in (forward, grad))
    if ep is not None:
        # Where the compiled forward puts the overlaps (async start/done on GPU).
        hlo = forward.as_text()
        report = ep_overlap_report(hlo)
        if args.dump_hlo:  # the GPU schedule, to read on a machine without GPUs
            os.makedirs(args.dump_hlo, exist_ok=True)
            name = f"{scaling}_T{shape.T}_ep{ep_size}_{dispatch}_{overlap}.hlo.txt"
            with open(os.path.join(args.dump_hlo, name), "w") as f:
                f.write(hlo)
        shared = report.get("shared", {})
        row["shared_in_dispatch"] = shared.get("between_start_and_done")
        row["combine_before_next_down"] = [c.get("combine_starts_first") for c in report["chunks"]]
        row["schedule"] = report
    with gpu_turn(args.gpu_lock, args.turn_limit):
        t_fwd = time_fn(forward, params, x, iters=args.iters)
        t_fb = time_fn(grad, params, x, iters=args.iters)
        if ep is not None and args.trace_steps:
            # What the GPUs did: collective time per forward and how much of it the
            # layer's kernels hid (the combine behind the next chunk's down-proj).
            row["forward_trace"] = collective_overlap(forward, params, x, steps=args.trace_steps)
    flops = shape.flops_fwd
    if ep is not None:
        row["link_gb_per_gpu"] = link_bytes_per_gpu(shape, ep_size, dispatch) / 1e9
    row.update({
        "fwd_ms": 1e3 * t_fwd, "fwd_bwd_ms": 1e3 * t_fb,
        # Model FLOPs per device (docs/math.md: 6PTnd forward, 18PTnd forward+backward).
        "fwd_bwd_tflops_per_gpu": 3 * flops / t_fb / 1e12 / ep_size,
    })
    return row


def report(rows: list[dict], checks: list[dict], args, devices: str, link_gbs: dict) -> str:
    """The markdown tables of the timing rows and the checks (`devices`: "2 x NVIDIA H200")."""
    strong = Shape.parse(args.shape)
    lines = [
        f"# EP layer benchmark: {devices}, backend={args.backend}, "
        f"routing={args.routing}{' (skewed)' if args.skew else ''}",
        "",
        f"d={strong.d}, n={strong.n}, E={strong.E}, K={strong.K}, {args.shared_experts} shared expert(s); "
        f"bf16 compute, params {args.param_dtype.name}; wall time, median of {args.iters}. Strong scaling: "
        f"global T={strong.T}; weak scaling: T={args.weak_tokens} per GPU. Chunked overlap: "
        f"{args.num_chunks} chunks. Schedule columns: from the compiled forward (None: collectives not async).",
        "",
        "| scaling | T | EP | dispatch | overlap | forward ms | fwd+bwd ms | fwd+bwd TFLOP/s per GPU "
        "| shared MLP inside dispatch | combine c before down-proj c+1 | forward collectives us (hidden) "
        "| link GB per GPU per step | link ms at measured GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines[2] += f" XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}."
    if link_gbs:
        lines[2] += (" Links: " + ", ".join(f"EP={e} {v:.0f} GB/s per GPU" for e, v in link_gbs.items())
                     + " (ring ppermute of 512 MB, every GPU sending); link GB: nominal bytes at uniform routing"
                     " (`link_bytes_per_gpu`).")
    for row in rows:
        head = f"| {row['scaling']} | {row['T']} | {row['ep']} | {row['dispatch']} | {row['overlap']} |"
        if "error" in row:
            lines.append(f"{head} error | {row['error']} | | | | | | |")
        else:
            traces = list(row.get("forward_trace", {}).values())
            comm = ""
            if traces:  # mean over the GPUs
                total = sum(t["collective_us"] for t in traces) / len(traces)
                hidden = sum(t["hidden_us"] for t in traces) / len(traces)
                comm = f"{total:.0f} ({100 * hidden / total:.0f}%)" if total else "0"
            lines.append(
                f"{head} {row['fwd_ms']:.2f} | {row['fwd_bwd_ms']:.2f} | {row['fwd_bwd_tflops_per_gpu']:.0f} | "
                f"{row.get('shared_in_dispatch', '')} | {row.get('combine_before_next_down', '')} | {comm} | "
                + (f"{row['link_gb_per_gpu']:.2f} | {1e3 * row['link_gb_per_gpu'] / link_gbs[row['ep']]:.2f} |"
                   if "link_gb_per_gpu" in row and link_gbs.get(row["ep"]) else " | |")
            )
    if checks:
        lines += ["", f"Correctness at {args.check_shape} (T,d,n,E,K), relative error vs one device:", ""]
        for c in checks:
            name = (f"EP={c['ep']} {c['dispatch']} overlap={c['overlap']} {c['routing']}"
                    f"{' skewed' if c['skew'] else ''} backend={c['backend']}{' check_vma' if c['check_vma'] else ''}")
            if "error" in c:
                lines.append(f"- {name}: error {c['error']} -> FAIL")
                continue
            worst_grad = max(c["dparams_rel_err"].values())
            lines.append(
                f"- {name}: y {c['y_rel_err']:.1e}, dx {c['dx_rel_err']:.1e}, "
                f"worst dparam {worst_grad:.1e} -> {'ok' if c['ok'] else 'FAIL'}"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mosaic", choices=BACKENDS)
    parser.add_argument("--shape", default="32768,4096,512,128,8", help="T,d,n,E,K of strong scaling (global T)")
    parser.add_argument("--weak-tokens", type=int, default=4096, dest="weak_tokens",
                        help="tokens per GPU of weak scaling (0: skip); d,n,E,K from --shape")
    parser.add_argument("--check-shape", default="4096,1024,256,16,4", help="T,d,n,E,K of the correctness check")
    parser.add_argument("--ep", default="2", help="comma-separated EP sizes besides EP=1")
    parser.add_argument("--dispatch", default="all_gather,ragged_all_to_all")
    parser.add_argument("--overlap", default="none,chunked", help="overlaps to run (none, chunked)")
    parser.add_argument("--num-chunks", type=lambda v: v if v == "auto" else int(v), default=2,
                        dest="num_chunks", help='chunks of the chunked overlap, or "auto"')
    parser.add_argument("--routing", default="topk", choices=("topk", "token_rounding"), help="routing of the timing runs")
    parser.add_argument("--tile", type=int, default=128)
    parser.add_argument("--shared-experts", type=int, default=1, dest="shared_experts",
                        help="shared experts of the layer (their MLP overlaps the dispatch)")
    parser.add_argument("--param-dtype", default="bfloat16", dest="param_dtype")
    parser.add_argument("--skew", action="store_true", help="skewed routing in the timing runs (checks run both)")
    parser.add_argument("--capacity-factor", type=float, default=None, dest="capacity_factor",
                        help="ragged dispatch receive buffer, x T_l*K rows (default: exact worst case)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tol", type=float, default=2e-2)
    parser.add_argument("--check-routings", default="topk,token_rounding", dest="check_routings",
                        help="routings of the correctness checks (to split the run over calls)")
    parser.add_argument("--scaling", default="strong,weak",
                        help="timing runs to do: strong, weak or both (to split the run over calls)")
    parser.add_argument("--trace-steps", type=int, default=3, dest="trace_steps",
                        help="forward calls traced per EP config for the collectives' hidden time (0: none)")
    parser.add_argument("--gpu-lock", default=None, dest="gpu_lock",
                        help="lock file: processes started side by side compile at once, run one at a time")
    parser.add_argument("--dump-hlo", default="", dest="dump_hlo",
                        help="directory for each EP config's compiled forward (HLO text)")
    parser.add_argument("--turn-limit", type=float, default=300.0, dest="turn_limit",
                        help="seconds one GPU turn may take under --gpu-lock before the process exits")
    parser.add_argument("--exchange-rows", default="", dest="exchange_rows",
                        help="comma-separated row counts: time the ragged collective alone at d of --shape, then exit")
    parser.add_argument("--xla-default-ragged", action="store_true", dest="xla_default_ragged",
                        help="keep XLA's default GPU ragged_all_to_all (else pm.nn.use_fast_ragged_all_to_all())")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--out", default=None, help="markdown table path (default benchmarks/results/ep_<device>.md)")
    args = parser.parse_args(argv)
    args.param_dtype = jnp.dtype(args.param_dtype)
    ep_sizes = [int(v) for v in args.ep.split(",") if v]
    dispatches = [v for v in args.dispatch.split(",") if v]
    overlaps = [v for v in args.overlap.split(",") if v]
    check_routings = [v for v in args.check_routings.split(",") if v]
    scalings = [v for v in args.scaling.split(",") if v]
    for name, values, allowed in (("--check-routings", check_routings, ("topk", "token_rounding")),
                                  ("--scaling", scalings, ("strong", "weak"))):
        if not values or any(v not in allowed for v in values):
            parser.error(f"{name} takes a comma-separated subset of {allowed}, got {values}")
    if "ragged_all_to_all" in dispatches and not (args.xla_default_ragged or args.exchange_rows):
        pm.nn.use_fast_ragged_all_to_all()  # before the backend starts (jax.devices() below)
    device = jax.devices()[0]
    print(f"devices: {len(jax.devices())} x {device.device_kind}; backend={args.backend}", flush=True)
    if max(ep_sizes) > len(jax.devices()):
        print(f"need {max(ep_sizes)} devices, have {len(jax.devices())}", file=sys.stderr)
        return 2

    if args.exchange_rows:
        d = Shape.parse(args.shape).d
        with gpu_turn(args.gpu_lock, args.turn_limit):
            for rows, e in ((int(v), e) for v in args.exchange_rows.split(",") for e in ep_sizes):
                print("exchange", json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""),
                                              **exchange_time_ms(e, rows, d)}), flush=True)
        return 0

    failed = False
    checks = []
    rows = []
    link_gbs = {}
    out = args.out or os.path.join(
        "benchmarks", "results", f"ep_{device.device_kind.replace(' ', '_')}_{args.backend}.md"
    )

    def save() -> str:
        # After every check and row, so that a process that is killed (a hung collective's
        # --turn-limit, a timeout) keeps the tables of what it finished.
        table = report(rows, checks, args, f"{len(jax.devices())} x {device.device_kind}", link_gbs)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(table)
        with open(os.path.splitext(out)[0] + ".json", "w") as f:
            json.dump({"checks": checks, "rows": rows}, f, indent=1, default=str)
        return table

    if not args.skip_check:
        shape = Shape.parse(args.check_shape)
        runs = [
            (ep_size, dispatch, overlap, routing, skew, args.backend, False)
            for ep_size in ep_sizes for dispatch, overlap in modes(dispatches, overlaps)
            for routing in check_routings for skew in (False, True)
        ]
        # The vma type check, on the xla backend (see the docstring), largest EP, skewed.
        runs += [
            (max(ep_sizes), dispatch, overlap, routing, True, "xla", True)
            for dispatch, overlap in modes(dispatches, overlaps) for routing in check_routings
        ]
        for ep_size, dispatch, overlap, routing, skew, backend, vma in runs:
            try:
                result = check(shape, ep_size, dispatch, overlap, routing, skew, args, backend, vma)
            except Exception as err:  # report and go on
                result = {"ep": ep_size, "dispatch": dispatch, "overlap": overlap, "routing": routing,
                          "skew": skew, "backend": backend, "check_vma": vma, "ok": False,
                          "error": f"{type(err).__name__}: {err}"[:300]}
            checks.append(result)
            failed |= not result["ok"]
            print("check", json.dumps(result), flush=True)
            save()

    if not args.skip_bench:
        with gpu_turn(args.gpu_lock, args.turn_limit):
            for e in ep_sizes:
                link_gbs[e] = link_bandwidth_gbs(e)
                print("link", json.dumps({"ep": e, "gb_per_s_per_gpu": link_gbs[e]}), flush=True)
        strong = Shape.parse(args.shape)
        configs = []
        if "strong" in scalings:
            configs += [("strong", strong, 1, None, "none")] + [
                ("strong", strong, e, d, o) for e in ep_sizes for d, o in modes(dispatches, overlaps)
            ]
        if args.weak_tokens and "weak" in scalings:
            for e in [1] + ep_sizes:
                weak = dataclasses.replace(strong, T=args.weak_tokens * e)
                configs += [("weak", weak, 1, None, "none")] if e == 1 else [
                    ("weak", weak, e, d, o) for d, o in modes(dispatches, overlaps)
                ]
        for scaling, shape, ep_size, dispatch, overlap in configs:
            try:
                row = bench(shape, ep_size, dispatch, overlap, args, scaling)
            except Exception as err:  # report and go on: one failing config must not hide the rest
                row = {"scaling": scaling, "T": shape.T, "ep": ep_size, "dispatch": dispatch or "-",
                       "overlap": overlap, "error": f"{type(err).__name__}: {err}"[:300]}
                failed = True
            rows.append(row)
            save()
            print("bench", json.dumps({k: v for k, v in row.items() if k not in ("schedule", "forward_trace")}),
                  flush=True)
            for gpu, t in row.get("forward_trace", {}).items():
                print("trace", json.dumps({"T": row["T"], "ep": row["ep"], "dispatch": row["dispatch"],
                                           "overlap": row["overlap"], "device": gpu,
                                           **{k: v for k, v in t.items() if k not in ("kernel_names", "timeline")}}),
                      flush=True)

    print(save())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
