"""Routing benchmark and on-device equality check (run on a GPU).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/routing.py --out $OUT
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/routing.py --out $OUT --token-rounding

For each (T, E, K) it builds the top-K plan (and the token-rounding plan) with every
implementation (`impl="dense"`, the reference; "sort", O(T*K) jnp; "kernel", the Pallas
routing kernel), checks on the device that each equals the reference row for row on fresh
random logits (with ties), and times, in the same run:
  - GPU kernel time of one jitted plan (CUPTI: the sum of every kernel the call launches),
    alone and with `tile_schedule(block_m=128)`;
  - wall time of one jitted call (median), which also counts launch gaps and any host work.
Prints a table and writes routing_results.json / routing_log.txt into --out.

Both modes also time each plan with every kernel's tile metadata of the 7B layer's kernel
configs (`kernels.schedules.plan_schedules`, what the `mosaic` op computes once per step for
the forward and backward): `*_with_schedules_gpu_us`.

`--token-rounding` does the same for `token_rounding_plan` (tile 128, `TR_SHAPES`): it first
checks on the device that each fast implementation's plan equals the dense one bitwise, every
field, for every rounding mode and score order (`TR_CHECKS`), and compares the gradients to
the logits; then times dense and fast (rounding "nearest", softmax_topk), alone and with the
tile schedule, GPU and wall, in the same run; then the fast kernel path with other selection
chunks (`--tr-chunks`; chunk 1 is one `lax.top_k` over [E, T]) and its per-kernel breakdown.
With "kernel" among the impls it also runs "kernel_top_k": the top-K kernels followed by the
previous jnp rounding (two `lax.top_k` selection levels, a sort, binary searches and
scatters: `round_by_kernels=False`), so the rounding kernels (`kernels.select_largest`,
`kernels.place_rounded`) are compared with it, and with dense, in one run.
Writes token_rounding_results.json / token_rounding_log.txt.

The issue-18 table, in two commands (about 5 and 8 minutes on an H100):

    ROUTING_SHAPES=32768x128x8,16384x512x10,512x128x8,64x128x8 PYTHONPATH=. PYTHONUNBUFFERED=1 \
        python3 benchmarks/routing.py --out $OUT
    TR_SHAPES=32768x128x8,16384x512x10,4096x128x8 PYTHONPATH=. PYTHONUNBUFFERED=1 \
        python3 benchmarks/routing.py --out $OUT --token-rounding --impls dense,sort,kernel --tr-chunks 16
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms, wall_time_ms
from benchmarks.logs import open_log
from jax.experimental.mosaic.gpu import profiler

import pallas_moe as pm
from pallas_moe.routing.plan import tile_schedule

# The kernel configs whose tile metadata `*_with_schedules` times: the 7B layer's defaults.
SCHEDULE_D, SCHEDULE_N = 1536, 256


def with_schedules(plan_fn):
    """`plan_fn(logits)` plus every kernel's tile metadata of the 7B configs, one program."""
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.schedules import plan_schedules

    forward = ForwardConfig.for_shape(SCHEDULE_D, SCHEDULE_N)
    backward = BackwardConfig.for_shape(SCHEDULE_D, SCHEDULE_N)
    return jax.jit(lambda l: plan_schedules(plan_fn(l), forward, backward))

SHAPES = [(32768, 128, 8), (24576, 128, 8), (16384, 512, 10), (4096, 128, 8),
          (512, 128, 8), (64, 128, 8)]
if os.environ.get("ROUTING_SHAPES"):  # e.g. "32768x128x8,64x128x8"
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["ROUTING_SHAPES"].split(",")]
PLAN_FIELDS = ("token_ids", "group_sizes", "is_token_choice", "rows_by_token", "token_row_offsets")
TR_SHAPES = [(32768, 128, 8), (24576, 128, 8), (16384, 512, 10), (4096, 128, 8)]
if os.environ.get("TR_SHAPES"):  # e.g. "32768x128x8"
    TR_SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["TR_SHAPES"].split(",")]
# (rounding, score, renormalize, with selection bias): every mode and score order once.
TR_CHECKS = [
    ("nearest", "softmax_topk", False, False),
    ("up", "sigmoid", True, True),
    ("down", "topk_softmax", False, False),
    ("stochastic", "softmax_topk", True, False),
    ("balance", "sigmoid", False, False),
]


def gpu_us(f, *args):
    return 1e3 * gpu_time_ms(f, *args, iters=20)


def wall_us(f, *args):
    return 1e3 * wall_time_ms(f, *args, iters=30)


def same_plan(a, b) -> tuple[bool, float]:
    exact = all(np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)))
                for f in PLAN_FIELDS)
    sa, sb = np.asarray(a.scores), np.asarray(b.scores)
    err = float(np.max(np.abs(sa - sb) / np.maximum(np.abs(sb), 1e-30)))
    return exact, err


def sweep_topk_blocks(log):
    """Times `kernels.topk_blocks` alone over block sizes and warps; checks each result."""
    from pallas_moe.routing import kernels

    shapes = SHAPES if os.environ.get("ROUTING_SHAPES") else [
        (32768, 128, 8), (16384, 512, 10), (512, 128, 8), (24576, 64, 4)]
    for T, E, K in shapes:
        sel = jax.nn.softmax(jax.random.normal(jax.random.key(T), (T, E)), axis=-1)
        want = kernels.topk_blocks(sel, K, block_t=16)
        want_ex = np.sort(np.asarray(jax.lax.top_k(sel, K)[1]), axis=1)
        assert np.array_equal(np.asarray(want[0]), want_ex), "topk_blocks != lax.top_k"
        for bt in (1, 2, 4, 8, 16):
            for nw in (2, 4, 8, 16):
                try:
                    f = jax.jit(lambda s, bt=bt, nw=nw: kernels.topk_blocks(
                        s, K, block_t=bt, num_warps=nw))
                    got = f(sel)
                    ok = np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
                    us = gpu_us(f, sel)
                    log(f"  topk_blocks T={T} E={E} K={K} block_t={bt} warps={nw}: {us:.1f} us ok={ok}")
                except Exception as e:  # noqa: BLE001
                    log(f"  topk_blocks T={T} E={E} K={K} block_t={bt} warps={nw}: failed {str(e)[:200]}")


def routing_logits(T, E, K):
    """f32[T, E] random logits; a quarter of the tokens coarsely rounded (ties)."""
    logits = jax.random.normal(jax.random.key(T + E + K), (T, E), jnp.float32)
    return logits.at[: T // 4].set(jnp.round(logits[: T // 4] * 2) / 2)


def plan_diff(got, want) -> dict:
    """Bitwise equality of every plan field (scores included) and the scores' max rel err."""
    fields = PLAN_FIELDS + ("scores",)
    unequal = [f for f in fields if not np.array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)))]
    sa, sb = np.asarray(got.scores), np.asarray(want.scores)
    err = float(np.max(np.abs(sa - sb) / np.maximum(np.abs(sb), 1e-30)))
    return dict(equal=not unequal, unequal_fields=unequal, score_rel_err=err)


def token_rounding(log, out_dir, impls, tile, chunks):
    """Token-rounding plans: device equality with the dense reference, then timings."""
    from pallas_moe.routing.token_rounding import selection_chunk, token_rounding_plan_fast

    kernel_impl = next((i for i in ("kernel", "interpret") if i in impls), None)
    variants = impls + ([f"{kernel_impl}_top_k"] if kernel_impl else [])
    fast_variants = [v for v in variants if v != "dense"]

    def build(variant, logits, K, **opts):
        """The plan of one implementation; "kernel_top_k": the top-K kernels, then the
        previous jnp selection and placement instead of the rounding kernels."""
        if variant.endswith("_top_k"):
            opts = {"rounding": "nearest", **opts}
            return token_rounding_plan_fast(
                logits, K, impl=variant.removesuffix("_top_k"), round_by_kernels=False, **opts)[0]
        return pm.routing.token_rounding_plan(logits, K, impl=variant, **opts)

    results = []
    for T, E, K in TR_SHAPES:
        logits = routing_logits(T, E, K)
        bias = 0.1 * jax.random.normal(jax.random.key(1), (E,), jnp.float32)
        key = jax.random.key(2)
        capacity = T * K + E * tile
        row = dict(T=T, E=E, K=K, tile=tile, chunk=selection_chunk(T, min(tile - 1, T)))

        def options(rounding, score, renormalize, with_bias):
            return dict(tile=tile, rounding=rounding, key=key, score=score,
                        renormalize=renormalize, bias=bias if with_bias else None)

        # 1. The device check, before any timing: every field bitwise, every mode.
        for rounding, score, renormalize, with_bias in TR_CHECKS:
            opts = options(rounding, score, renormalize, with_bias)
            want = jax.jit(lambda l, o=opts: pm.routing.token_rounding_plan(l, K, impl="dense", **o))(logits)
            for impl in fast_variants:
                got = jax.jit(lambda l, o=opts, i=impl: build(i, l, K, **o))(logits)
                diff = plan_diff(got, want)
                row[f"{impl}_equal_{rounding}_{score}"] = diff["equal"]
                if not diff["equal"]:
                    log(f"  TR {T},{E},{K} {rounding} {score} {impl}: NOT EQUAL {diff}")
        # Gradients to the logits (XLA may round each program's backward differently).
        weights = jnp.arange(capacity, dtype=jnp.float32) % 7 - 3.0
        grads = {}
        for impl in variants:
            grads[impl] = np.asarray(jax.jit(jax.grad(
                lambda l, i=impl: jnp.sum(build(i, l, K, tile=tile).scores * weights)
            ))(logits))
        for impl in fast_variants:
            scale = max(float(np.max(np.abs(grads["dense"]))), 1e-30)
            row[f"{impl}_grad_bitwise"] = bool(np.array_equal(grads[impl], grads["dense"]))
            row[f"{impl}_grad_max_err_over_max"] = float(np.max(np.abs(grads[impl] - grads["dense"]))) / scale

        # 2. Timings, same run: dense and fast, alone and with the tile schedule.
        for impl in variants:
            fn = jax.jit(lambda l, i=impl: build(i, l, K, tile=tile))
            fn_ts = jax.jit(lambda l, i=impl: tile_schedule(
                build(i, l, K, tile=tile).group_sizes, capacity, 128))
            fn_all = with_schedules(lambda l, i=impl: build(i, l, K, tile=tile))
            try:
                row[f"{impl}_gpu_us"] = gpu_us(fn, logits)
                row[f"{impl}_with_tiles_gpu_us"] = gpu_us(fn_ts, logits)
                row[f"{impl}_with_schedules_gpu_us"] = gpu_us(fn_all, logits)
                row[f"{impl}_wall_us"] = wall_us(fn, logits)
            except Exception as e:  # noqa: BLE001 - report and go on
                log(f"  TR {T},{E},{K} {impl}: FAILED {type(e).__name__}: {str(e)[:400]}")
        # 3. Selection chunk sweep of the kernel path, and where its time goes.
        if kernel_impl:
            # Jitted, like the plans it is compared with: an eager dense plan's scores can
            # differ in the last bit (op-by-op rounding vs XLA's fusions).
            reference = jax.jit(
                lambda l: pm.routing.token_rounding_plan(l, K, tile=tile, impl="dense"))(logits)
            for chunk in chunks:
                fn = jax.jit(lambda l, c=chunk: token_rounding_plan_fast(
                    l, K, tile=tile, rounding="nearest", impl=kernel_impl, chunk=c)[0])
                try:
                    row[f"{kernel_impl}_chunk{chunk}_equal"] = plan_diff(fn(logits), reference)["equal"]
                    row[f"{kernel_impl}_chunk{chunk}_gpu_us"] = gpu_us(fn, logits)
                except Exception as e:  # noqa: BLE001
                    log(f"  TR {T},{E},{K} chunk {chunk}: FAILED {type(e).__name__}: {str(e)[:400]}")
            fn = jax.jit(lambda l: pm.routing.token_rounding_plan(l, K, tile=tile, impl=kernel_impl))
            jax.block_until_ready(fn(logits))
            _, timings = profiler.measure(fn, aggregate=False)(logits)
            log(f"  TR {kernel_impl}-impl breakdown {T},{E},{K}: " + ", ".join(
                f"{name.split('(')[0][:40]} {1e3 * ms:.1f}us" for name, ms in timings))
        log("  " + json.dumps({k: (round(v, 2) if isinstance(v, float) and v > 1e-3 else v)
                               for k, v in row.items()}))
        results.append(row)
        with open(os.path.join(out_dir, "token_rounding_results.json"), "w") as f:
            json.dump(results, f, indent=1)

    cols = ["T", "E", "K", "tile", "chunk"]
    for impl in variants:
        cols += [f"{impl}_gpu_us", f"{impl}_with_tiles_gpu_us", f"{impl}_with_schedules_gpu_us",
                 f"{impl}_wall_us"]
    cols += [f"{impl}_grad_bitwise" for impl in fast_variants]
    log("| " + " | ".join(cols) + " | all equal |")
    log("|" + "---|" * (len(cols) + 1))
    for r in results:
        equal = all(v for k, v in r.items() if "_equal" in k)
        log("| " + " | ".join(
            (f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-"))) for c in cols)
            + f" | {equal} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--impls", default="dense,sort,kernel")
    p.add_argument("--sweep", action="store_true", help="time topk_blocks over block sizes only")
    p.add_argument("--token-rounding", action="store_true", help="token-rounding plans only")
    p.add_argument("--tile", type=int, default=128, help="token-rounding tile")
    p.add_argument("--tr-chunks", default="1,4,8,16,32",
                   help="selection chunks to time on the token-rounding kernel path ('' for none)")
    args = p.parse_args()
    if args.token_rounding:
        log = open_log(args.out, "token_rounding_log.txt")
        chunks = [int(c) for c in args.tr_chunks.split(",") if c]
        token_rounding(log, args.out, args.impls.split(","), args.tile, chunks)
        return
    log = open_log(args.out, "routing_log.txt")
    if args.sweep:
        sweep_topk_blocks(log)
        return
    impls = args.impls.split(",")
    results = []
    for T, E, K in SHAPES:
        logits = routing_logits(T, E, K)
        for score, renorm in [("softmax_topk", False), ("sigmoid", True)]:
            row = dict(T=T, E=E, K=K, score=score)
            plans = {}
            for impl in impls:
                fn = jax.jit(lambda l, impl=impl: pm.routing.topk_plan(
                    l, K, score=score, renormalize=renorm, impl=impl))
                fn_ts = jax.jit(lambda l, impl=impl: tile_schedule(
                    pm.routing.topk_plan(l, K, score=score, renormalize=renorm, impl=impl).group_sizes,
                    T * K, 128))
                fn_all = with_schedules(lambda l, impl=impl: pm.routing.topk_plan(
                    l, K, score=score, renormalize=renorm, impl=impl))
                try:
                    plans[impl] = fn(logits)
                    row[f"{impl}_gpu_us"] = gpu_us(fn, logits)
                    row[f"{impl}_with_tiles_gpu_us"] = gpu_us(fn_ts, logits)
                    row[f"{impl}_with_schedules_gpu_us"] = gpu_us(fn_all, logits)
                    row[f"{impl}_wall_us"] = wall_us(fn, logits)
                except Exception as e:  # noqa: BLE001 - report and go on
                    log(f"  {T},{E},{K} {score} {impl}: FAILED {type(e).__name__}: {str(e)[:400]}")
            if "kernel" in plans and score == "softmax_topk":
                fn = jax.jit(lambda l: pm.routing.topk_plan(l, K, score=score, impl="kernel"))
                jax.block_until_ready(fn(logits))
                _, timings = profiler.measure(fn, aggregate=False)(logits)
                log(f"  kernel-impl breakdown {T},{E},{K}: " + ", ".join(
                    f"{name.split('(')[0][:40]} {1e3 * ms:.1f}us" for name, ms in timings))
            for impl in impls:
                if impl != "dense" and impl in plans and "dense" in plans:
                    exact, err = same_plan(plans[impl], plans["dense"])
                    row[f"{impl}_equal"] = exact
                    row[f"{impl}_score_rel_err"] = err
            log("  " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}))
            results.append(row)
            with open(os.path.join(args.out, "routing_results.json"), "w") as f:
                json.dump(results, f, indent=1)

    cols = ["T", "E", "K", "score"]
    for impl in impls:
        cols += [f"{impl}_gpu_us", f"{impl}_with_tiles_gpu_us", f"{impl}_with_schedules_gpu_us",
                 f"{impl}_wall_us"]
        if impl != "dense":
            cols += [f"{impl}_equal"]
    log("| " + " | ".join(cols) + " |")
    log("|" + "---|" * len(cols))
    for r in results:
        log("| " + " | ".join(
            (f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-"))) for c in cols) + " |")


if __name__ == "__main__":
    main()
