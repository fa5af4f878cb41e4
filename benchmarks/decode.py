"""Decode-size MoE forward: the kernel-by-kernel path against the megakernel (run on an H100).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/decode.py --out $OUT

The Qwen3-30B-A3B MoE layer (d=2048, n=768, E=128, K=8) at T in {1, 8, 64, 128, 512, 1024,
4096} tokens, routing (`topk_plan` over random logits) included in every timed call. For each
T, in the same run:
- `kernels`: `pm.moe_ffn(backend="mosaic", config=KernelConfig.for_shape(d, n))`, this
  library's kernel-by-kernel forward (routing metadata, up-proj, down-proj, aggregation).
  Not differentiated, so it writes no H (since session 12; before, it wrote H for a backward
  that never came);
- `auto` (with --variants): `pm.moe_ffn(backend="mosaic")` with no config, the library's
  default: the megakernel up to `moe_forward.decode_max_tokens()` tokens, else `kernels`;
- `kernels_inf` (with --variants): `moe_forward(..., inference=True)`, the same kernels
  called directly;
- `kernels_meta` (with --variants): `kernels` with the tile metadata from one Pallas launch
  (`ForwardConfig.schedule_impl="kernel"`, `schedules.forward_schedule_kernel`) instead of
  8 small XLA fusions (issue 15);
- `kernels_agg4` (with --variants): `kernels` with the aggregation as before session 66: 4
  tokens per CTA at every T (`AggregateConfig.resident_ctas=0`) and one row at a time
  (`rows_in_flight=1`), so a decode batch's tokens sit on a few CTAs, each walking its rows
  as one chain of dependent loads;
- `static`, `dynamic`: the megakernel (`pallas_moe.kernels.decode`) with each scheduler;
- `unfused` (and `unfused_dyn` with --variants): the megakernel's control, the same task code
  with a global barrier between stages;
- `bound`: the weight-read bound, the bytes of the distinct experts the batch touches over the
  HBM bandwidth measured here (a 1 GiB device copy).
Times: GPU time (CUPTI, every kernel of one call summed, median of --iters calls), the
MoE kernels alone (the same profile without routing and metadata kernels), and wall time of
one jitted call. Each variant's output is checked against the `xla` backend on poisoned
buffers before it is timed; a wrong variant is reported, not timed.

Writes decode_log.txt, decode.json and decode_RESULTS.md (the table) under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

import pallas_moe as pm
from benchmarks.forward import wall_time_ms
from benchmarks.logs import open_log
from pallas_moe.kernels import KernelConfig
from pallas_moe.kernels.decode import DecodeConfig, moe_decode
from pallas_moe.kernels.moe_forward import moe_forward

D, N, E, K = 2048, 768, 128, 8
TOKENS = (1, 8, 64, 128, 512, 1024, 4096)
# Megakernel variants: DecodeConfig overrides on top of DecodeConfig.for_shape(d, n).
MEGA_VARIANTS = {
    "static": dict(),
    "dynamic": dict(scheduler="dynamic"),
    "unfused": dict(fused=False),
    "unfused_dyn": dict(fused=False, scheduler="dynamic"),
    # Block-size alternatives (not run by default).
    "static_u128": dict(up_block_n=128, num_stages=3),
    "dynamic_u128": dict(scheduler="dynamic", up_block_n=128, num_stages=3),
    "static_bn256": dict(down_block_n=256, num_stages=3),
    "static_s4": dict(num_stages=4),  # the default until session 12
    "static_s5": dict(num_stages=5),
    "static_s6": dict(num_stages=6),
    "static_s7": dict(num_stages=7),  # fits without H (inference) only
    # The one-TMA-per-row gather (no cp.async group waits in the producer; session 12).
    "static_tma": dict(gather="tma"),
    # The full-precision exp in the up tasks' SwiGLU (the default is ex2.approx, session 12).
    "static_exact": dict(approx_math=False),
    "static_bt16": dict(token_block=16),
    # (Session 64 removed "static_regs", setmaxnreg's register split, `rebalance_registers`:
    # 0.95x at T = 1, 1.008x at T = 2 on the H100.)
    # The per-plan metadata from one Pallas program instead of six small XLA kernels
    # (session 40, `pallas_moe/kernels/decode_meta.py`) at every T, or never (the default,
    # "auto", takes it up to `decode_meta.META_KERNEL_MAX_TOKENS` tokens).
    "static_meta": dict(meta_impl="kernel"),
    "dynamic_meta": dict(scheduler="dynamic", meta_impl="kernel"),
    "static_jnp": dict(meta_impl="jnp"),
}
VARIANTS = ("kernels", "kernels_inf", "kernels_meta", "kernels_agg4", "auto", *MEGA_VARIANTS)
# A variant without a suffix routes as the library does by default (the one-program
# small-batch kernel up to `routing.kernels.SMALL_BATCH_DEFAULT` tokens). The suffix
# `+small` routes every batch of up to 32 tokens with it (`small_batch_routing`), e.g.
# `static_meta+small`: routing and metadata in two Pallas programs instead of ~14 kernels;
# `+blocks` never does (the block path of top-K, prefix sums and placement).
SMALL, BLOCKS = "+small", "+blocks"
SUFFIXES = (SMALL, BLOCKS)


def split_variant(variant: str) -> tuple[str, str]:
    """"static_meta+small" -> ("static_meta", "+small"); no suffix -> (variant, "")."""
    for suffix in SUFFIXES:
        if variant.endswith(suffix):
            return variant.removesuffix(suffix), suffix
    return variant, ""
DEFAULT_VARIANTS = ("kernels", "static", "dynamic", "unfused")
# CUPTI kernel names of the MoE kernels (everything else is routing or metadata).
MOE_KERNELS = ("moe_decode", "moe_up_proj", "moe_down_proj", "moe_aggregate")
# The metadata kernels (the megakernel's `decode_meta`, the kernel path's
# `forward_schedule_kernel`): counted in the total, not in "MoE kernels alone". A kernel
# counts as MoE if one of MOE_KERNELS is in its name, so none may be in these.
META_KERNELS = ("moe_tile_meta", "moe_forward_schedules")
assert not any(k in m for k in MOE_KERNELS for m in META_KERNELS)
BYTES_PER_EXPERT = (D * 2 * N + N * D) * 2


def make_ffn(variant: str, overrides: dict):
    """(x, plan, w1, w2) -> out for one variant."""
    if variant in ("kernels", "kernels_meta", "kernels_agg4"):  # never the megakernel
        config = KernelConfig.for_shape(D, N)
        forward = config.forward
        if variant == "kernels_meta":  # the tile metadata from one Pallas launch
            forward = dataclasses.replace(forward, schedule_impl="kernel")
        if variant == "kernels_agg4":  # the aggregation before session 66
            forward = dataclasses.replace(forward, aggregate=dataclasses.replace(
                forward.aggregate, resident_ctas=0, rows_in_flight=1))
        config = dataclasses.replace(config, forward=forward)
        return lambda x, p, w1, w2: pm.moe_ffn(x, p, w1, w2, backend="mosaic", config=config)
    if variant == "auto":  # the library's default (the megakernel up to decode_max_tokens())
        return lambda x, p, w1, w2: pm.moe_ffn(x, p, w1, w2, backend="mosaic")
    if variant == "kernels_inf":
        return lambda x, p, w1, w2: moe_forward(x, p, w1, w2, inference=True)[0]
    config = DecodeConfig.for_shape(D, N, **{**MEGA_VARIANTS[variant], **overrides})
    return lambda x, p, w1, w2: moe_decode(x, p, w1, w2, config=config)[0]


def profile_ms(f, *args, iters):
    """(median total GPU ms, median GPU ms of the MoE kernels) over `iters` calls (CUPTI)."""
    jax.block_until_ready(f(*args))
    _, per_call = profiler.measure(f, aggregate=False, iterations=max(iters, 2))(*args)
    totals = [sum(ms for _, ms in call) for call in per_call]
    moe = [sum(ms for name, ms in call if any(k in name for k in MOE_KERNELS)) for call in per_call]
    return statistics.median(totals), statistics.median(moe), per_call[0]


def poison(nbytes):
    junk = jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16)
    junk.block_until_ready()
    del junk


def rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def hbm_gbs(iters):
    """Device copy bandwidth (read + write of a 1 GiB bf16 array), GB/s."""
    v = jax.random.normal(jax.random.key(9), (1 << 29,), jnp.bfloat16)
    f = jax.jit(lambda v: v + 1)
    total, _, _ = profile_ms(f, v, iters=iters)
    return 2 * v.size * 2 / (total * 1e-3) / 1e9


def make_weights():
    """The layer's bf16 weights (seed 0): (w_gate_up [E, d, 2n], w_down [E, n, d])."""
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = (jax.random.normal(k1, (E, D, 2 * N), jnp.float32) * D**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (E, N, D), jnp.float32) * N**-0.5).astype(jnp.bfloat16)
    return w1, w2


def make_tokens(T):
    """A batch of T tokens (seed T): (x bf16 [T, d], router logits f32 [T, E])."""
    kx, kl = jax.random.split(jax.random.key(T))
    x = jax.random.normal(kx, (T, D), jnp.float32).astype(jnp.bfloat16)
    return x, jax.random.normal(kl, (T, E), jnp.float32)


def small_routing(suffix: str):
    """The context a variant's call is traced in: the small-batch routing limit its suffix
    asks for (`+small`: 32 tokens, `+blocks`: none), or the library's default."""
    import contextlib

    from pallas_moe.routing import kernels

    if suffix == SMALL:
        return kernels.small_batch_routing(kernels.SMALL_BATCH_TOKENS)
    if suffix == BLOCKS:
        return kernels.small_batch_routing(0)
    return contextlib.nullcontext()


def run_tokens(T, variants, overrides, w1, w2, bw, iters, log):
    x, logits = make_tokens(T)
    route = jax.jit(lambda l: pm.routing.topk_plan(l, K))
    with small_routing(BLOCKS):  # the block path: the plan every variant is checked against
        plan = route(logits)  # traced here
    touched = int(jnp.sum(plan.group_sizes > 0))
    res = dict(T=T, experts=touched, bound_us=touched * BYTES_PER_EXPERT / (bw * 1e9) * 1e6)
    res["routing_us"] = profile_ms(route, logits, iters=iters)[0] * 1e3
    res["routing_wall_us"] = wall_time_ms(route, logits, iters=iters) * 1e3
    if any(v.endswith(SMALL) for v in variants):
        route_small = jax.jit(lambda l: pm.routing.topk_plan(l, K))
        with small_routing(SMALL):
            small_plan = route_small(logits)  # traced here
        same = all(bool(jnp.array_equal(getattr(small_plan, f), getattr(plan, f)))
                   for f in ("token_ids", "scores", "group_sizes", "rows_by_token"))
        res["routing_small_us"] = profile_ms(route_small, logits, iters=iters)[0] * 1e3
        log(f"  small-batch routing: {res['routing_small_us']:.1f} us GPU, plan bitwise the "
            f"default's: {same}")
    ref = jax.jit(lambda x, p, w1, w2: pm.moe_ffn(x, p, w1, w2, backend="xla"))(x, plan, w1, w2)
    log(f"== T={T}: {touched} experts touched, bound {res['bound_us']:.1f} us, "
        f"routing {res['routing_us']:.1f} us GPU / {res['routing_wall_us']:.1f} us wall")
    outs = {}
    for v in variants:
        try:
            name, suffix = split_variant(v)
            ffn = make_ffn(name, overrides)
            f = jax.jit(lambda l, x, w1, w2, ffn=ffn: ffn(x, pm.routing.topk_plan(l, K), w1, w2))
            poison(T * K * (3 * N + 2 * D) * 2 + (E + T * K // 64) * 64 * (N + D) * 2)
            t0 = time.perf_counter()
            with small_routing(suffix):  # traced (and compiled) here
                out = jax.block_until_ready(f(logits, x, w1, w2))
            res[f"{v}_first_call_s"] = time.perf_counter() - t0  # mostly compilation
            err = rel_err(out, ref)
            outs[v] = out
            res[f"{v}_err"] = err
            if not err < 1e-2:
                log(f"  {v}: WRONG (rel err {err:.2e}), not timed")
                continue
            total, moe, kernels = profile_ms(f, logits, x, w1, w2, iters=iters)
            res[f"{v}_us"] = total * 1e3
            res[f"{v}_moe_us"] = moe * 1e3
            res[f"{v}_wall_us"] = wall_time_ms(f, logits, x, w1, w2, iters=iters) * 1e3
            log(f"  {v}: {res[f'{v}_us']:.1f} us GPU (MoE kernels {res[f'{v}_moe_us']:.1f}), "
                f"{res[f'{v}_wall_us']:.1f} us wall, err {err:.1e}, first call "
                f"{res[f'{v}_first_call_s']:.1f} s; kernels: "
                + ", ".join(f"{name} {ms * 1e3:.1f}" for name, ms in kernels))
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            log(f"  {v}: failed: {type(e).__name__}: {str(e)[:400]}")
            log(traceback.format_exc(limit=3))
    if "kernels" in outs:
        for v, out in outs.items():
            res[f"{v}_bitwise_kernels"] = bool(np.array_equal(np.asarray(out), np.asarray(outs["kernels"])))
    log("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}))
    return res


def fmt(r, key, digits=0):
    v = r.get(key)
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(r, num, den):
    a, b = r.get(num), r.get(den)
    return "-" if a is None or b is None else f"{a / b:.2f}"


def markdown(results, variants, bw, cmd, device, overrides):
    mega = [v for v in variants if v not in ("kernels", "kernels_inf")]
    lines = [
        f"# Decode-size MoE forward on {device}",
        "",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}. jax {jax.__version__}. "
        f"Qwen3-30B-A3B MoE layer (d={D}, n={N}, E={E}, K={K}), top-K routing over random logits. "
        f"Measured HBM bandwidth (device copy): {bw:.0f} GB/s. Megakernel overrides: {overrides or 'none'}.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "GPU time (CUPTI, all kernels of one jitted call, routing included), microseconds; "
        "`X speedup` = kernels time / X time:",
        "",
        "| T | experts | bound | routing | " + " | ".join(variants) + " | "
        + " | ".join(f"{v} speedup" for v in mega) + " |",
        "|" + "---|" * (4 + len(variants) + len(mega)),
    ]
    for r in results:
        lines.append(
            f"| {r['T']} | {r['experts']} | {r['bound_us']:.1f} | {fmt(r, 'routing_us', 1)} | "
            + " | ".join(fmt(r, f"{v}_us", 1) for v in variants) + " | "
            + " | ".join(ratio(r, "kernels_us", f"{v}_us") for v in mega) + " |"
        )
    lines += [
        "",
        "The MoE kernels alone (the same profiles without routing and metadata kernels), and "
        "their ratio to the weight-read bound (1.0 = at the bound):",
        "",
        "| T | bound | " + " | ".join(variants) + " | " + " | ".join(f"{v} / bound" for v in mega) + " |",
        "|" + "---|" * (2 + len(variants) + len(mega)),
    ]
    for r in results:
        lines.append(
            f"| {r['T']} | {r['bound_us']:.1f} | "
            + " | ".join(fmt(r, f"{v}_moe_us", 1) for v in variants) + " | "
            + " | ".join(ratio(r, f"{v}_moe_us", "bound_us") for v in mega) + " |"
        )
    lines += [
        "",
        "Wall time of one jitted call (routing included, launch gaps and host work included), "
        "microseconds:",
        "",
        "| T | routing | " + " | ".join(variants) + " |",
        "|" + "---|" * (2 + len(variants)),
    ]
    for r in results:
        lines.append(
            f"| {r['T']} | {fmt(r, 'routing_wall_us', 1)} | "
            + " | ".join(fmt(r, f"{v}_wall_us", 1) for v in variants) + " |"
        )
    lines += ["", "Correctness (relative error against the xla backend; bitwise equal to `kernels`):", ""]
    for r in results:
        parts = []
        for v in variants:
            err = r.get(f"{v}_err")
            text = "-" if err is None else f"{err:.1e}"
            if r.get(f"{v}_bitwise_kernels"):
                text += " (bitwise)"
            parts.append(f"{v} {text}")
        lines.append(f"- T={r['T']}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, from {VARIANTS}, each optionally with a suffix from {SUFFIXES}"
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--config", default="{}",
        help='JSON overrides of DecodeConfig for the megakernel variants, e.g. \'{"up_block_n": 128}\'',
    )
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = {v for v in variants if split_variant(v)[0] not in VARIANTS}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    overrides = json.loads(args.config)
    log = open_log(args.out, "decode_log.txt")
    cmd = "PYTHONPATH=. python3 " + " ".join(sys.argv)
    log(f"cmd: {cmd}")
    w1, w2 = make_weights()
    bw = hbm_gbs(args.iters)
    log(f"HBM bandwidth (device copy): {bw:.0f} GB/s")
    results = []
    for T in (int(t) for t in args.tokens.split(",")):
        results.append(run_tokens(T, variants, overrides, w1, w2, bw, args.iters, log))
        with open(os.path.join(args.out, "decode.json"), "w") as f:
            json.dump(dict(hbm_gbs=bw, overrides=overrides, results=results), f, indent=1)
    table = markdown(results, variants, bw, cmd, jax.devices()[0].device_kind, overrides)
    with open(os.path.join(args.out, "decode_RESULTS.md"), "w") as f:
        f.write(table)
    log(table)


if __name__ == "__main__":
    main()
