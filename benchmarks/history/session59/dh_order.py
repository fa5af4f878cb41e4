"""dH's work-item order (issue 9, session 59): column blocks fastest (the library's kernel
since session 59, `dh.item_coords`) against row tiles fastest (the previous version),
same run, paired rounds (GPU us, CUPTI).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/history/session59/dh_order.py 30b,7b,qwen3-30b-a3b,gpt-oss-20b [rounds]

Hypothesis: with row tiles fastest every column block is a separate pass over all the
row tiles, and where n needs more than one block (30B: 2 of 256 columns; Qwen3-30B-A3B: 3;
gpt-oss-20b: 15 of 192) each pass gathers all of dO again; at 30B dO (268 MB) does not fit
the 50 MB L2 between a token's uses, so that is ~2.1 GB more of HBM reads a pass.
Prediction: 30B dH faster by >= 10% (2705 us -> <= 2450), 7B unchanged (one column block:
the same walk), gpt-oss (dO 47 MB, about the L2) little.

Both orders compute every item the same way, so dH, A' and dS must be bitwise equal; the
library's kernel is also checked against XLA's intermediates, on poisoned outputs.
"""

from __future__ import annotations

import functools
import statistics
import sys

import numpy as np

import jax

from benchmarks.backward import SHAPES, make_case, poison_then, reference_intermediates, rel_err, saved_h
from benchmarks.forward import gpu_time_ms
from benchmarks.step import rows_first_dh_items
from pallas_moe.kernels import _common, dh as dh_mod
from pallas_moe.kernels.moe_backward import BackwardConfig


def build(cfg, meta, args, previous: bool):
    f = jax.jit(functools.partial(dh_mod.dh_kernel, config=cfg, meta=meta))
    if not previous:
        return f.lower(*args).compile()
    with rows_first_dh_items():  # the order before session 59
        return f.lower(*args).compile()


def main():
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["30b", "7b"]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    table = []
    for name in shapes:
        T, d, n, E, K = shape = SHAPES[name]
        x, w1, w2, plan, go = make_case(shape, seed=len(name) * 7 + 1)
        P, rows = plan.capacity, int(plan.num_rows)
        h = jax.block_until_ready(saved_h(x, plan, w1))
        r_dh, r_ap, r_ds, _ = jax.block_until_ready(reference_intermediates(h, plan, w1, w2, go))
        cfg = BackwardConfig.for_shape(d, n).dh
        grid_n = n // (cfg.block_n * cfg.num_consumers)
        print(f"== {name} {shape}: grid_n {grid_n}, {cfg}", flush=True)
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.tile_rows))(
            plan.group_sizes, plan.token_ids)
        args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
        fns = {"previous": build(cfg, meta, args, True), "columns": build(cfg, meta, args, False)}
        nbytes = P * 3 * n * 2
        new = poison_then(fns["columns"], *args, nbytes=nbytes)
        err = max(rel_err(new[0], r_dh, rows), rel_err(new[1], r_ap, rows), rel_err(new[2], r_ds))
        again = fns["columns"](*args)
        repeat = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(new, again))
        old = poison_then(fns["previous"], *args, nbytes=nbytes)
        same = all(np.array_equal(np.asarray(a)[:rows], np.asarray(b)[:rows])
                   for a, b in zip(new[:2], old[:2])) and np.array_equal(
                       np.asarray(new[2]), np.asarray(old[2]))
        print(f"  columns-first vs XLA: max rel err {err:.2e}; bitwise repeat {repeat}; "
              f"bitwise the previous order (dH, A' real rows, dS): {same}", flush=True)
        del new, again, old
        times = {"previous": [], "columns": []}
        for r in range(rounds):
            for v in (("previous", "columns") if r % 2 == 0 else ("columns", "previous")):
                times[v].append(gpu_time_ms(fns[v], *args) * 1e3)
        med = {v: statistics.median(t) for v, t in times.items()}
        spread = {v: (max(t) - min(t)) / med[v] for v, t in times.items()}
        speedup = statistics.median(a / b for a, b in zip(times["previous"], times["columns"]))
        flops = 2 * P * n * d
        print(f"  previous {med['previous']:.1f} us (spread {spread['previous']:.1%}), columns "
              f"first {med['columns']:.1f} us (spread {spread['columns']:.1%}): "
              f"{speedup:.3f}x paired; {flops / med['columns'] / 1e6:.0f} TFLOP/s", flush=True)
        table.append((name, grid_n, med["previous"], med["columns"], speedup, err, same))
    print("\n| shape | column blocks | previous us (rows first) | columns first us | "
          "previous / new, paired | new vs XLA | bitwise |")
    print("|---|---|---|---|---|---|---|")
    for name, g, a, b, s, e, same in table:
        print(f"| {name} | {g} | {a:.1f} | {b:.1f} | {s:.3f} | {e:.1e} | {same} |")


if __name__ == "__main__":
    main()
