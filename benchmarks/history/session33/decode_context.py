"""Session 33 (issue 15): why the decode megakernel takes ~3 us more inside the op's jitted
call (31.4 us at T = 1, `decode.py`) than in a loop of itself (28.3, `decode_phases.py`).

The same kernel (T = 1 static default, Qwen3-30B-A3B widths, the same inputs) timed by
CUPTI in five programs, rounds in alternating order; the figure is the megakernel's own
kernel time (the other kernels of each program listed once):

- `alone`: the kernel, metadata precomputed (a loop of itself).
- `after_small_xla`: small XLA kernels first (a sum over the [T, d] input, added as 0): does any
  kernel in front of it (shared-memory carve-out reconfigured, launch state) cost?
- `after_big_xla`: an XLA sum over 128 MB first (L2 emptied of the weights left by the
  previous call).
- `meta_inside`: `moe_decode` (its metadata's XLA kernels in the same program).
- `op`: the whole op with routing, as `decode.py` times it.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/history/session33/decode_context.py \
        --out $OUT [--tokens 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
import pallas_moe as pm  # noqa: E402
from benchmarks.decode import D, K, N, make_tokens, make_weights, profile_ms  # noqa: E402
from benchmarks.logs import open_log  # noqa: E402
from pallas_moe.kernels.decode import DecodeConfig, decode_meta, decode_tasks, moe_decode  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    log = open_log(args.out, "decode_context_log.txt")
    log(f"device: {jax.devices()[0].device_kind}")
    w1, w2 = make_weights()  # decode.py's inputs
    config = DecodeConfig.for_shape(D, N)
    big = jnp.zeros((64 << 20,), jnp.bfloat16)  # 128 MB
    table = []
    for T in (int(t) for t in args.tokens.split(",")):
        x, logits = make_tokens(T)
        plan = jax.jit(lambda l: pm.routing.topk_plan(l, K))(logits)
        meta = jax.jit(lambda p: decode_meta(p, config, D))(plan)

        def after(a):  # a bf16 zero that XLA must compute from `a` first
            return (jnp.sum(a.astype(jnp.float32)) * 0).astype(jnp.bfloat16)

        def run(x, p, m):
            return decode_tasks(x, p, w1, w2, config=config, meta=m).out

        cases = {
            "alone": (jax.jit(run), (x, plan, meta)),
            # (x * 0 is not simplified away for floats: NaN; the sum orders the kernels)
            "after_small_xla": (jax.jit(lambda x, p, m: run(x + after(x), p, m)), (x, plan, meta)),
            "after_big_xla": (jax.jit(lambda x, p, m, b: run(x + after(b), p, m)),
                              (x, plan, meta, big)),
            "meta_inside": (jax.jit(lambda x, p: moe_decode(x, p, w1, w2, config=config)[0]),
                            (x, plan)),
            "op": (jax.jit(lambda l, x: moe_decode(x, pm.routing.topk_plan(l, K), w1, w2,
                                                   config=config)[0]), (logits, x)),
        }
        times = {name: [] for name in cases}
        names = list(cases)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                f, fargs = cases[name]
                _, moe_ms, kernels = profile_ms(f, *fargs, iters=args.iters)
                us = moe_ms * 1e3  # the megakernel: the programs' only MoE kernel
                times[name].append(us)
                if r == 0:
                    log(f"  T={T} {name}: megakernel {us:.1f} us; program: " + ", ".join(
                        f"{k} {ms * 1e3:.1f}" for k, ms in kernels))
        row = dict(T=T, **{n: statistics.median(v) for n, v in times.items()},
                   spread={n: [round(t, 1) for t in v] for n, v in times.items()})
        log(json.dumps(row))
        table.append(row)
    log("\n| T | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1) + "\n" + "\n".join(
        f"| {r['T']} | " + " | ".join(f"{r[n]:.1f}" for n in names) + " |" for r in table))


if __name__ == "__main__":
    main()
