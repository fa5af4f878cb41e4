"""Session 11 A/B: the up-proj with its SwiGLU in an epilogue warpgroup (persistent, H staged
in a weight slot; `UpProjConfig.epilogue_warpgroup`) against the warp-specialized default.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/history/session11/epilogue_wg.py --out $OUT

For each shape: the default checked against the XLA reference; every variant bitwise
against its base (same `approx_math`), poisoned outputs, H and A over all real rows; then
CUPTI GPU time of each (training and inference mode), the dense batched-matmul bound of
the up-proj's FLOPs, and the whole forward with the default and with the best variant.

Needs `epilogue_wg_experiment.patch` applied (main dropped the kernel and the A/B switch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from benchmarks.logs import open_log  # noqa: E402
from benchmarks.forward import (  # noqa: E402
    SHAPES, dense_bound_ms, gpu_time_ms, make_case, poison_then, reference_tiles, rel_err,
)
from pallas_moe.kernels import _common  # noqa: E402
from pallas_moe.kernels.moe_forward import ForwardConfig, moe_forward  # noqa: E402
from pallas_moe.kernels.up_proj import up_proj  # noqa: E402


def variants(d, n):
    base = ForwardConfig.for_shape(d, n).up
    epi = dataclasses.replace(base, epilogue_warpgroup=True)
    out = {
        "ws": base,
        "ws+approx": dataclasses.replace(base, approx_math=True),
        "epi": epi,
        "epi+approx": dataclasses.replace(epi, approx_math=True),
    }
    if n % 128 == 0:
        out["epi bn64 5st"] = dataclasses.replace(epi, block_n=64, num_stages=5)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="7b,30b")
    args = p.parse_args()
    log = open_log(args.out, "epilogue_wg_log.txt")
    table, results = [], []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        T, d, n, E, K = shape
        for skew in (False, True):
            x, w1, w2, plan = make_case(shape, skew, seed=hash((name, skew)) % 1000)
            P, rows = plan.capacity, int(plan.num_rows)
            h_ref, a_ref, _, _ = jax.jit(reference_tiles)(x, plan, w1, w2)
            res = dict(shape=name, skew=skew)
            outs, times = {}, {}
            for vname, cfg in variants(d, n).items():
                meta = jax.jit(lambda g, t, bm=cfg.block_m: _common.tile_meta(g, t, bm))(
                    plan.group_sizes, plan.token_ids)
                for inference in (False, True):
                    f = jax.jit(lambda x, t, g, w, m, cfg=cfg, inf=inference: up_proj(
                        x, t, g, w, config=cfg, meta=m, inference=inf))
                    try:
                        h, a = poison_then(f, x, plan.token_ids, plan.group_sizes, w1, meta,
                                           nbytes=P * 3 * n * 2)
                    except Exception as e:  # noqa: BLE001
                        log(f"  {name} skew={skew} {vname} inf={inference}: FAILED {type(e).__name__}: {str(e)[:400]}")
                        continue
                    outs[(vname, inference)] = (h, a)
                    basis = "ws+approx" if "approx" in vname else "ws"
                    if (basis, inference) in outs and vname != basis:
                        hb, ab = outs[(basis, inference)]
                        same = bool(np.array_equal(np.asarray(a[:rows]), np.asarray(ab[:rows])))
                        if h is not None:
                            same &= bool(np.array_equal(np.asarray(h[:rows]), np.asarray(hb[:rows])))
                        res[f"bitwise {vname} inf={inference}"] = same
                        if not same:
                            log(f"  {name} skew={skew} {vname} inf={inference}: NOT BITWISE equal to {basis}")
                    if vname == "ws" and not inference:
                        res["err_h"] = rel_err(h, h_ref, rows)
                        res["err_a"] = rel_err(a, a_ref, rows)
                    times[(vname, inference)] = gpu_time_ms(f, x, plan.token_ids, plan.group_sizes, w1, meta) * 1e3
                    log(f"  {name} skew={skew} {vname} inf={inference}: {times[(vname, inference)]:.1f} us")
            del outs
            bound_up, _ = dense_bound_ms(shape)
            res["bound_up_us"] = bound_up * 1e3
            res["times"] = {f"{k[0]} inf={k[1]}": v for k, v in times.items()}
            # The whole forward: default against the fastest epilogue-warpgroup variant (exact exp).
            exact = {k: v for k, v in times.items() if not k[1] and k[0].startswith("epi") and "approx" not in k[0]}
            if exact:
                best = min(exact, key=exact.get)[0]
                base = ForwardConfig.for_shape(d, n)
                new = dataclasses.replace(base, up=variants(d, n)[best])
                for label, cfg in (("fwd default", base), (f"fwd {best}", new)):
                    f = jax.jit(lambda x, p, a, b, cfg=cfg: moe_forward(x, p, a, b, config=cfg))
                    res[label] = gpu_time_ms(f, x, plan, w1, w2) * 1e3
                    log(f"  {name} skew={skew} {label}: {res[label]:.1f} us")
            log("  " + json.dumps(res, default=str))
            results.append(res)
            ws = times.get(("ws", False), float("nan"))
            for k, v in times.items():
                table.append((name, skew, k[0], k[1], v, v / ws, res["bound_up_us"] / v))
    with open(os.path.join(args.out, "epilogue_wg.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    log("\n| shape | skew | variant | inference | us | vs ws | of dense bound |")
    log("|---|---|---|---|---|---|---|")
    for row in table:
        log(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {row[4]:.1f} | {row[5]:.3f} | {row[6]:.3f} |")


if __name__ == "__main__":
    main()
