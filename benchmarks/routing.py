"""Routing benchmark and on-device equality check (run on a GPU).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/routing.py --out $OUT

For each (T, E, K) it builds the top-K plan (and the token-rounding plan) with every
implementation (`impl="dense"`, the reference; "sort", O(T*K) jnp; "kernel", the Pallas
routing kernel), checks on the device that each equals the reference row for row on fresh
random logits (with ties), and times, in the same run:
  - GPU kernel time of one jitted plan (CUPTI: the sum of every kernel the call launches),
    alone and with `tile_schedule(block_m=128)`;
  - wall time of one jitted call (median), which also counts launch gaps and any host work.
Prints a table and writes routing_results.json / routing_log.txt into --out.
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

SHAPES = [(32768, 128, 8), (24576, 128, 8), (16384, 512, 10), (4096, 128, 8),
          (512, 128, 8), (64, 128, 8)]
if os.environ.get("ROUTING_SHAPES"):  # e.g. "32768x128x8,64x128x8"
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["ROUTING_SHAPES"].split(",")]
PLAN_FIELDS = ("token_ids", "group_sizes", "is_token_choice", "rows_by_token", "token_row_offsets")


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

    for T, E, K in [(32768, 128, 8), (16384, 512, 10), (512, 128, 8), (24576, 64, 4)]:
        sel = jax.nn.softmax(jax.random.normal(jax.random.key(T), (T, E)), axis=-1)
        want = kernels.topk_blocks(sel, K, block_t=16)
        want_ex = np.sort(np.asarray(jax.lax.top_k(sel, K)[1]), axis=1)
        assert np.array_equal(np.asarray(want[0]), want_ex), "topk_blocks != lax.top_k"
        for bt in (4, 8, 16, 32, 64):
            for nw in (1, 2, 4, 8):
                try:
                    f = jax.jit(lambda s, bt=bt, nw=nw: kernels.topk_blocks(
                        s, K, block_t=bt, num_warps=nw))
                    got = f(sel)
                    ok = np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
                    us = gpu_us(f, sel)
                    log(f"  topk_blocks T={T} E={E} K={K} block_t={bt} warps={nw}: {us:.1f} us ok={ok}")
                except Exception as e:  # noqa: BLE001
                    log(f"  topk_blocks T={T} E={E} K={K} block_t={bt} warps={nw}: failed {str(e)[:200]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--impls", default="dense,sort,kernel")
    p.add_argument("--sweep", action="store_true", help="time topk_blocks over block sizes only")
    args = p.parse_args()
    log = open_log(args.out, "routing_log.txt")
    if args.sweep:
        sweep_topk_blocks(log)
        return
    impls = args.impls.split(",")
    results = []
    for T, E, K in SHAPES:
        key = jax.random.key(T + E + K)
        logits = jax.random.normal(key, (T, E), jnp.float32)
        # Ties: a quarter of the tokens get coarsely rounded logits.
        logits = logits.at[: T // 4].set(jnp.round(logits[: T // 4] * 2) / 2)
        for score, renorm in [("softmax_topk", False), ("sigmoid", True)]:
            row = dict(T=T, E=E, K=K, score=score)
            plans = {}
            for impl in impls:
                fn = jax.jit(lambda l, impl=impl: pm.routing.topk_plan(
                    l, K, score=score, renormalize=renorm, impl=impl))
                fn_ts = jax.jit(lambda l, impl=impl: tile_schedule(
                    pm.routing.topk_plan(l, K, score=score, renormalize=renorm, impl=impl).group_sizes,
                    T * K, 128))
                try:
                    plans[impl] = fn(logits)
                    row[f"{impl}_gpu_us"] = gpu_us(fn, logits)
                    row[f"{impl}_with_tiles_gpu_us"] = gpu_us(fn_ts, logits)
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
        cols += [f"{impl}_gpu_us", f"{impl}_with_tiles_gpu_us", f"{impl}_wall_us"]
        if impl != "dense":
            cols += [f"{impl}_equal"]
    log("| " + " | ".join(cols) + " |")
    log("|" + "---|" * len(cols))
    for r in results:
        log("| " + " | ".join(
            (f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-"))) for c in cols) + " |")


if __name__ == "__main__":
    main()
