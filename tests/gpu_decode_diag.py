"""Narrows down a failure of `tests/test_gpu_decode.py` on the H100 (a script, not a test).

    PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 150 python3 tests/gpu_decode_diag.py

One case (the Qwen3 layer of `test_gpu_decode.py`, T = 64, the plan of its 100-runs test),
each line as soon as it is measured (a timeout still leaves the first lines):
1. each task kind alone, against the jnp references (no events between kinds, no kind
   change inside a CTA): `up` (A slab), `down` (Y slab from the reference A), `up+down`
   (Y slab: the up -> down hand-over through `up_done`, and the kind change in a CTA);
2. the whole kernel in several variants, 5 runs each: the worst relative error against the
   `xla` backend and how many distinct outputs the 5 runs gave. `static_1cta` runs every
   task on one SM (no cross-CTA traffic: if only it passes, suspect the cross-CTA memory
   ordering; if it fails too, the CTA-local pipeline); `tma` swaps the cp.async gather for
   TMA row copies; `no_l2_prefetch` and `depth1` (mailbox depth 1) change the timing.

`DIAG_INTERPRET=1` runs a small version in interpret mode on the CPU (checks the script).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())

import pallas_moe as pm  # noqa: E402
from pallas_moe.kernels.decode import (  # noqa: E402
    DecodeConfig, decode_meta, decode_tasks, max_decode_tiles, moe_decode,
)
from pallas_moe.kernels.reference import down_proj_reference, up_proj_reference  # noqa: E402

INTERPRET = os.environ.get("DIAG_INTERPRET") == "1"
if INTERPRET:
    T, D, N, E, K, RUNS = 8, 128, 128, 4, 2, 1
else:
    T, D, N, E, K, RUNS = 64, 2048, 768, 128, 8, 5


def _case():
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = (jax.random.normal(k1, (E, D, 2 * N), jnp.float32) * D**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (E, N, D), jnp.float32) * N**-0.5).astype(jnp.bfloat16)
    kx, kl = jax.random.split(jax.random.key(1000 * T + 3))
    x = jax.random.normal(kx, (T, D), jnp.float32).astype(jnp.bfloat16)
    plan = jax.jit(lambda l: pm.routing.topk_plan(l, K))(jax.random.normal(kl, (T, E), jnp.float32))
    return x, plan, w1, w2


def _rel(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = int(np.sum(~np.isfinite(got)))
    got = np.where(np.isfinite(got), got, 0.0)
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    return f"rel_err={err:.4f}" + (f" NaN={nan}" if nan else "")


def _slab_rows(slab, meta, capacity, bm=64):
    """Grouped rows [P, cols] from a tile-major slab (real rows only; others zero)."""
    slab = np.asarray(slab, np.float32)
    rows = np.zeros((capacity, slab.shape[1]), np.float32)
    for t in range(int(meta.counts[0])):
        s, r = int(meta.row_start[t]), int(meta.num_rows[t])
        rows[s:s + r] = slab[t * bm:t * bm + r]
    return rows


def _to_slab(rows, meta, max_tiles, bm=64):
    rows = np.asarray(rows, np.float32)
    slab = np.zeros((max_tiles * bm, rows.shape[1]), np.float32)
    for t in range(int(meta.counts[0])):
        s, r = int(meta.row_start[t]), int(meta.num_rows[t])
        slab[t * bm:t * bm + r] = rows[s:s + r]
    return jnp.asarray(slab, jnp.bfloat16)


def main():
    x, plan, w1, w2 = _case()
    base = DecodeConfig.for_shape(D, N)
    if INTERPRET:
        base = dataclasses.replace(base, num_sms=1, gather="tma", num_stages=2)
    interp = True if INTERPRET else False
    meta = decode_meta(plan, base, D)
    cap = plan.capacity
    max_tiles = max_decode_tiles(cap, E, 64)
    _, a_ref = up_proj_reference(x, plan.token_ids, plan.group_sizes, w1)
    y_ref = down_proj_reference(a_ref, plan.group_sizes, w2)
    out_ref = jax.jit(lambda x, p, a, b: pm.moe_ffn(x, p, a, b, backend="xla"))(x, plan, w1, w2)
    rows = int(plan.num_rows)
    a_ref, y_ref = np.asarray(a_ref, np.float32)[:rows], np.asarray(y_ref, np.float32)[:rows]
    print(f"T={T} real tiles={int(meta.counts[0])} max_tiles={max_tiles} rows={rows}", flush=True)

    def kinds_run(name, kinds, pick, want, **kw):
        t0 = time.time()
        f = jax.jit(lambda x, p, a, b: pick(decode_tasks(
            x, p, a, b, config=base, kinds=kinds, interpret=interp, **kw)))
        got = [_slab_rows(f(x, plan, w1, w2), meta, cap)[:rows] for _ in range(RUNS)]
        distinct = len({g.tobytes() for g in got})
        worst = max((_rel(g, want) for g in got), key=lambda s: float(s.split("=")[1].split()[0]))
        print(f"{name:16s} {worst} distinct={distinct}/{RUNS} ({time.time() - t0:.0f}s)", flush=True)

    kinds_run("up alone", ("up",), lambda o: o.a_slab, a_ref)
    kinds_run("down alone", ("down",), lambda o: o.y_slab, y_ref,
              a_slab=_to_slab(np.pad(a_ref, ((0, cap - rows), (0, 0))), meta, max_tiles))
    kinds_run("up+down", ("up", "down"), lambda o: o.y_slab, y_ref)

    variants = {
        "static": {},
        "dynamic": dict(scheduler="dynamic"),
        "unfused": dict(fused=False),
        "static_1cta": dict(num_sms=1),
        "tma": dict(gather="tma"),
        "no_l2_prefetch": dict(prefetch_l2=False),
        "depth1": dict(mailbox_depth=1),
    }
    if INTERPRET:
        variants = {"static": {}, "dynamic": dict(scheduler="dynamic", num_sms=2)}
    for name, over in variants.items():
        t0 = time.time()
        cfg = dataclasses.replace(base, **over)
        f = jax.jit(lambda x, p, a, b, cfg=cfg: moe_decode(
            x, p, a, b, config=cfg, interpret=interp)[0])
        outs = [np.asarray(f(x, plan, w1, w2), np.float32) for _ in range(RUNS)]
        distinct = len({o.tobytes() for o in outs})
        worst = max((_rel(o, out_ref) for o in outs), key=lambda s: float(s.split("=")[1].split()[0]))
        print(f"{name:16s} {worst} distinct={distinct}/{RUNS} ({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
