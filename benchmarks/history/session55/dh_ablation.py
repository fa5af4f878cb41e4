"""What dH's epilogue costs today (issue 9): the default persistent dH kernel against
ablations of its per-item epilogue, same run, paired rounds (GPU us, CUPTI).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/history/session55/dh_ablation.py 7b,30b [rounds] [variants]

Variants (each a monkeypatch of `pallas_moe.kernels.dh` / `_common` at trace time; only the
default writes valid outputs, the others are timing probes):
  default     the library's kernel (checked against XLA's dH, A', dS first, poisoned outputs)
  no_hload    the consumers do not load H (the slabs hold whatever is there)
  no_math     dSwiGLU replaced by a pass-through (dH = H, A' = H gate, dS = row sums of dA')
  no_store    the dH and A' TMA stores skipped (dS still copied)
  no_epi      all three: the K loop plus the item hand-offs only
  pf4, pf8    the library's kernel with `DHConfig.h_prefetch_steps` = 4 / 8 (the producer
              prefetches the item's H rows into L2 that many K steps before the item's end);
              checked bitwise against the default on poisoned outputs
  c4, c4s4    (session 56) four consumer warpgroups of 64 columns instead of two of 128 (the
              same 256-column items; 5 / 4 stages): each consumer's epilogue is half as
              long, with 104 registers a thread instead of 232 (112 until session 56's
              `consumer_registers` fix; 112 hung the H100). dH and A' checked bitwise
              against the default; dS sums its 64-column partials in another order, so it
              is checked against XLA's

If no_epi is far below default, an epilogue that overlaps the next item's K loop (a fourth
warpgroup fed through SMEM, or per-consumer ping-pong buffers) is worth building for dH;
if it is close, the K loop itself is the limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import sys
from unittest import mock

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.backward import SHAPES, make_case, poison_then, reference_intermediates, rel_err, saved_h
from benchmarks.forward import gpu_time_ms
from pallas_moe.kernels import _common, dh as dh_mod
from pallas_moe.kernels.moe_backward import BackwardConfig


def _no_math(da, g, u, s, activation=None):
    return g, u, g, jnp.sum(da, axis=1)


def _skip(*args, **kwargs):
    return None


PATCHES = {
    "default": [],
    "no_hload": [(_common, "cp_async_load_rows", _skip)],
    "no_math": [(dh_mod, "dswiglu_epilogue", _no_math)],
    "no_store": [(_common, "store_row_tile", _skip)],
    "no_epi": [(_common, "cp_async_load_rows", _skip), (dh_mod, "dswiglu_epilogue", _no_math),
               (_common, "store_row_tile", _skip)],
    "pf4": [],
    "pf8": [],
    "c4": [],
    "c4s4": [],
}
OVERRIDES = {
    "pf4": dict(h_prefetch_steps=4), "pf8": dict(h_prefetch_steps=8),
    "c4": dict(block_n=64, num_consumers=4),
    "c4s4": dict(block_n=64, num_consumers=4, num_stages=4),
}


@contextlib.contextmanager
def patched(variant):
    with contextlib.ExitStack() as stack:
        for mod, name, fn in PATCHES[variant]:
            stack.enter_context(mock.patch.object(mod, name, fn))
        yield


def main():
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["7b", "30b"]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    variants = sys.argv[3].split(",") if len(sys.argv) > 3 else list(PATCHES)
    assert variants[0] == "default" and set(variants) <= set(PATCHES), variants
    rows_out = []
    for name in shapes:
        shape = SHAPES[name]
        T, d, n, E, K = shape
        x, w1, w2, plan, go = make_case(shape, seed=len(name) * 7 + 1)
        P, rows = plan.capacity, int(plan.num_rows)
        h = jax.block_until_ready(saved_h(x, plan, w1))
        r_dh, r_ap, r_ds, _ = jax.block_until_ready(reference_intermediates(h, plan, w1, w2, go))
        cfg = BackwardConfig.for_shape(d, n).dh
        print(f"== {name} {shape}: {cfg}", flush=True)
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.tile_rows))(
            plan.group_sizes, plan.token_ids)
        args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
        fns = {}
        for variant in variants:
            vcfg = dataclasses.replace(cfg, **OVERRIDES.get(variant, {}))
            vmeta = meta if vcfg.tile_rows == cfg.tile_rows else jax.jit(  # (session 57)
                lambda g, t: _common.tile_meta(g, t, vcfg.tile_rows))(
                plan.group_sizes, plan.token_ids)
            with patched(variant):
                f = jax.jit(functools.partial(dh_mod.dh_kernel, config=vcfg, meta=vmeta))
                f = f.lower(*args).compile()  # traced and compiled under the patch
            fns[variant] = f
        out = poison_then(fns["default"], *args, nbytes=P * 3 * n * 2)
        err = max(rel_err(out[0], r_dh, rows), rel_err(out[1], r_ap, rows), rel_err(out[2], r_ds))
        again = fns["default"](*args)
        bitwise = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out, again))
        print(f"  default vs XLA: max rel err {err:.2e}, bitwise repeat {bitwise}", flush=True)
        for v in (v for v in variants if v in OVERRIDES):
            got = poison_then(fns[v], *args, nbytes=P * 3 * n * 2)
            # dS of a config with other column blocks sums its partials in another order.
            checked = zip(out, got) if v.startswith("pf") else zip(out[:2], got[:2])
            same = all(np.array_equal(np.asarray(a)[:rows], np.asarray(b)[:rows])
                       for a, b in checked)
            ds_err = rel_err(got[2], r_ds)
            print(f"  {v} bitwise the default (poisoned, real rows): {same}; dS vs XLA "
                  f"{ds_err:.2e}", flush=True)
            del got
        del out, again
        times = {v: [] for v in variants}
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                times[v].append(gpu_time_ms(fns[v], *args) * 1e3)
        base = statistics.median(times["default"])
        for v in variants:
            med = statistics.median(times[v])
            spread = (max(times[v]) - min(times[v])) / med
            ratio = statistics.median(a / b for a, b in zip(times["default"], times[v]))
            print(f"  {v:9s} {med:9.1f} us  default/this paired {ratio:.3f}  spread {spread:.1%}",
                  flush=True)
            rows_out.append((name, v, med, ratio, spread, base))
        flops = 2 * P * n * d
        print(f"  dH FLOPs {flops / 1e9:.1f} G: default {flops / base / 1e6:.0f} TFLOP/s", flush=True)
    print("\n| shape | variant | us (median) | default / variant, paired | spread |")
    print("|---|---|---|---|---|")
    for name, v, med, ratio, spread, _ in rows_out:
        print(f"| {name} | {v} | {med:.1f} | {ratio:.3f} | {spread:.1%} |")


if __name__ == "__main__":
    main()
