"""Session 20: the ping-pong up-proj (`UpProjConfig.pingpong_ctas`) against the cooperative
default, same run: bitwise equality on poisoned outputs, CUPTI time, the dense bound.

    PYTHONPATH=. python3 benchmarks/history/session20/pingpong_up.py 7b,30b [widths]

Shapes are `benchmarks.forward.SHAPES` names; a `+skew` suffix skews the routing. With
`widths`: only the previous default against the ping-pong kernel's default form; with
`prefetch`: also the ping-pong kernel with the L2 prefetch of its gathered rows.
"""
import dataclasses
import sys

import jax
import numpy as np

from benchmarks.forward import (
    PINGPONG_UP, SHAPES, cooperative_up_cfg, dense_bound_ms, gpu_time_ms, make_case, poison_then,
)
from pallas_moe.kernels import _common
from pallas_moe.kernels.up_proj import up_proj


def variants(base):
    pp = dataclasses.replace(base, pingpong_ctas=132)
    out = {}
    for stages, tiles, comp in ((4, 3, "wait_group"), (5, 1, "wait_group"), (5, 1, "mbarrier")):
        out[f"pp s{stages} t{tiles} {comp}"] = dataclasses.replace(
            pp, num_stages=stages, epilogue_tiles=tiles, gather_completion=comp)
    return out


def widths(d, n):
    """Call 3: the previous default against the ping-pong kernel's default form."""
    return {"previous default": cooperative_up_cfg(n), "pp s5 t1 wait_group": dataclasses.replace(PINGPONG_UP, gather_completion="wait_group")}


rows_out = []
for name in sys.argv[1].split(","):
    shape = SHAPES[name.removesuffix("+skew")]
    T, d, n, E, K = shape
    x, w1, _, plan = make_case(shape, skew=name.endswith("+skew"), seed=11)
    rows = int(plan.num_rows)
    meta = jax.jit(lambda g, t: _common.tile_meta(g, t, 64))(plan.group_sizes, plan.token_ids)
    t_bmm = dense_bound_ms(shape)[0]
    modes = (False, True)
    if sys.argv[2:] == ["widths"]:
        cfgs = widths(d, n)
    elif sys.argv[2:] == ["prefetch"]:  # call 5: the L2 prefetch of the gathered rows
        cfgs = widths(d, n)
        pp = cfgs["pp s5 t1 wait_group"]
        for ahead in (8, 16):
            cfgs[f"pp + L2 prefetch {ahead} steps ahead"] = dataclasses.replace(
                pp, prefetch_steps=ahead)
        modes = (False,)
    else:
        cfgs = {"cooperative (default)": cooperative_up_cfg(n), **variants(cooperative_up_cfg(n))}
    ref = None
    for label, cfg in cfgs.items():
        for inference in modes:
            f = jax.jit(lambda x, t, g, w, cfg=cfg, inf=inference: up_proj(
                x, t, g, w, config=cfg, meta=meta, inference=inf))
            try:
                h, a = poison_then(f, x, plan.token_ids, plan.group_sizes, w1,
                                   nbytes=plan.capacity * 3 * n * 2)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {label} inf={inference}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            a = np.asarray(a[:rows].astype(np.float32))
            if not inference:
                h = np.asarray(h[:rows].astype(np.float32))
            if ref is None:
                ref = (h, a)
                eq = "ref"
            else:
                eq = bool(np.array_equal(a, ref[1]) and (inference or np.array_equal(h, ref[0])))
            nan = int(np.isnan(a).sum()) + (0 if inference else int(np.isnan(h).sum()))
            t = gpu_time_ms(f, x, plan.token_ids, plan.group_sizes, w1) * 1e3
            line = (f"| {name} | {label} | {'A only' if inference else 'H, A'} | {t:.1f} | "
                    f"{t_bmm * 1e3 / t:.3f} | {eq} | {nan} |")
            print(line, flush=True)
            rows_out.append(line)
    print(f"{name}: dense bound (up) {t_bmm * 1e3:.1f} us", flush=True)
    rows_out.append(f"| {name} | dense bound | | {t_bmm * 1e3:.1f} | 1 | | |")

print("\n| shape | kernel | writes | us | x/bmm | bitwise = default | NaNs |")
print("|---|---|---|---|---|---|---|")
print("\n".join(rows_out))
