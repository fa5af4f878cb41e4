"""Session 61 (issue 15): session 32's phase split of the decode megakernel, on an H100 and on
today's kernel (session 58 removed the split-K and early-weights options, so their up
variants are gone; the bare W1 stream also runs on twice the CTAs, `probe_up_split2`, to see
whether 96 streaming SMs or the HBM set the up phase's pace).

Session 32's description follows.

Where the decode megakernel's 45 us at T = 1 go, phase by phase.

The megakernel on each subset of its task kinds (`decode_tasks(kinds=...)`: waits on kinds
that do not run are skipped), the plan's metadata precomputed so that the timed program is
the kernel alone, against the bare stream of the same W1 bytes in the up tasks' order
(`stream_probe.stream_up_phase`) and the weight-read bound, all in one run, rounds in
alternating order. Config variants of the up phase (`--up-variants`) on the up kinds alone.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/history/session32/decode_phases.py \
        --out $OUT [--tokens 1,8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
import pallas_moe as pm  # noqa: E402
from benchmarks.decode import (  # noqa: E402
    BYTES_PER_EXPERT, D, K, N, hbm_gbs, make_tokens, make_weights, profile_ms)
from benchmarks.logs import open_log  # noqa: E402
from benchmarks.stream_probe import stream_up_phase  # noqa: E402
from pallas_moe.kernels.decode import DecodeConfig, decode_meta, decode_tasks  # noqa: E402

KINDS = {
    "all": ("up", "down", "aggregate"),
    "up": ("up",),
    "up_down": ("up", "down"),
    "down": ("down",),
    "down_agg": ("down", "aggregate"),
    "agg": ("aggregate",),
}
UP_VARIANTS = {
    "up_tma": dict(gather="tma"),
    "up_s6": dict(num_stages=6),
    "up_s3": dict(num_stages=3),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", default="", help="comma-separated cases (default: all)")
    args = ap.parse_args()
    log = open_log(args.out, "decode_phases_log.txt")
    bw = hbm_gbs(args.iters)
    log(f"device: {jax.devices()[0].device_kind}; copy {bw:.0f} GB/s")
    w1, w2 = make_weights()  # decode.py's inputs
    base = DecodeConfig.for_shape(D, N)
    table = []
    for T in (int(t) for t in args.tokens.split(",")):
        x, logits = make_tokens(T)
        plan = jax.jit(lambda l: pm.routing.topk_plan(l, K))(logits)
        touched = np.flatnonzero(np.asarray(plan.group_sizes) > 0)
        meta = jax.jit(lambda p: decode_meta(p, base, D))(plan)
        ref = jax.jit(lambda x, p: pm.moe_ffn(x, p, w1, w2, backend="xla"))(x, plan)
        full = jax.jit(lambda x, p, m: decode_tasks(x, p, w1, w2, config=base, meta=m))(
            x, plan, meta)
        err = float(jnp.linalg.norm((full.out - ref).astype(jnp.float32))
                    / jnp.linalg.norm(ref.astype(jnp.float32)))
        log(f"== T={T}: {len(touched)} experts, bound {len(touched) * BYTES_PER_EXPERT / bw / 1e3:.1f} "
            f"us, all-kinds err vs xla {err:.1e}")
        diag = any(os.environ.get(v) == "1" for v in ("PM_DIAG_NO_GATHER", "PM_DIAG_NO_MMA"))
        assert diag or err < 1e-2, err  # decode_diag.patch's switches compute garbage
        a_slab, y_slab = full.a_slab, full.y_slab

        def fn(kinds, config):  # (jitted f, its arguments): nothing big closed over
            extra = {}
            if "down" in kinds and "up" not in kinds:
                extra["a_slab"] = a_slab
            if "aggregate" in kinds and "down" not in kinds:
                extra["y_slab"] = y_slab
            m = meta if config == base else jax.jit(lambda p: decode_meta(p, config, D))(plan)
            names = tuple(extra)
            f = jax.jit(lambda x, p, a, b, m, *ex: decode_tasks(
                x, p, a, b, config=config, kinds=kinds, meta=m, **dict(zip(names, ex))).out)
            return f, (x, plan, w1, w2, m, *extra.values())

        cases = {name: fn(kinds, base) for name, kinds in KINDS.items()}
        for name, over in UP_VARIANTS.items():
            cases[name] = fn(("up",), DecodeConfig.for_shape(D, N, **over))
        w1_touched = w1[touched].reshape(-1, 2 * N)
        cases["probe_up"] = (jax.jit(lambda w: stream_up_phase(
            w, d=D, n=N, u=64, split=1, stages=5, order="strips")), (w1_touched,))
        cases["probe_up_split2"] = (jax.jit(lambda w: stream_up_phase(
            w, d=D, n=N, u=64, split=2, stages=5, order="strips")), (w1_touched,))
        if args.only:
            cases = {k: v for k, v in cases.items() if k in args.only.split(",")}
        times = {name: [] for name in cases}
        names = list(cases)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                f, fargs = cases[name]
                total, moe, kernels = profile_ms(f, *fargs, iters=args.iters)
                times[name].append(total * 1e3)
                if r == 0:
                    log(f"  {name}: {total * 1e3:.1f} us; " + ", ".join(
                        f"{k} {ms * 1e3:.1f}" for k, ms in kernels))
        row = dict(T=T, experts=len(touched), bound_us=len(touched) * BYTES_PER_EXPERT / bw / 1e3,
                   **{name: statistics.median(v) for name, v in times.items()},
                   spread={name: [round(t, 1) for t in v] for name, v in times.items()})
        log(json.dumps(row))
        table.append(row)
    names = [k for k in table[0] if k not in ("T", "experts", "spread")]
    log("\n| T | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1) + "\n" + "\n".join(
        f"| {r['T']} | " + " | ".join(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k])
                                      for k in names) + " |" for r in table))


if __name__ == "__main__":
    main()
