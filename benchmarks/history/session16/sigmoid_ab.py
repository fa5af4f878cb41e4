"""Session 16: the SwiGLU kernels' sigmoid with its reciprocal as `rsqrt.approx` squared
(`_common.kernel_sigmoid(True)`, the approx_math default now) against the IEEE division it
replaces (the previous default), same run, same inputs, default configs.

    git apply benchmarks/history/session16/sigmoid_rsqrt_experiment.patch
    PYTHONPATH=. python3 benchmarks/history/session16/sigmoid_ab.py [7b,30b]

Measured no faster (calls 1-2) and not kept: the patch restores the experiment's library
code.

The previous kernels are traced with `_common.kernel_sigmoid` patched back to
`jax.nn.sigmoid` (the library has no switch for it). Outputs are computed right after a
NaN buffer was freed; H must be bitwise equal between the variants; A, dH, A' and dS are
compared with each other and with a float64 numpy reference of the formula on the
kernel's own H (A) and inputs (dH). Then three alternating timing rounds (CUPTI).
"""
import json
import sys

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.backward import make_case
from benchmarks.forward import gpu_time_ms, poison_then
from pallas_moe.kernels import _common
from pallas_moe.kernels.config import KernelConfig
from pallas_moe.kernels.dh import dh_kernel
from pallas_moe.kernels.up_proj import up_proj

SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8)}


def traced(fn, args, exact: bool):
    """jit of a fresh wrapper of fn (jit caches traces per function object: the same fn
    would reuse the first variant's trace), traced now, with the previous sigmoid if
    `exact`."""
    f = jax.jit(lambda *a: fn(*a))
    saved = _common.kernel_sigmoid
    if exact:
        _common.kernel_sigmoid = lambda approx: jax.nn.sigmoid
    try:
        out = f(*args)  # the jit cache now holds this variant's executable
        jax.block_until_ready(out)
    finally:
        _common.kernel_sigmoid = saved
    return f


def sig64(x):
    return 1.0 / (1.0 + np.exp(-x))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def main(names):
    rows_out = []
    for name in names:
        T, d, n, E, K = SHAPES[name]
        x, w1, w2, plan, go = make_case(SHAPES[name], seed=16)
        cfg = KernelConfig.for_shape(d, n)
        P, rows = plan.capacity, int(plan.num_rows)
        up_args = (x, plan.token_ids, plan.group_sizes, w1)
        up_fn = lambda *a: up_proj(*a, config=cfg.forward.up)
        fns = {("up", v): traced(up_fn, up_args, v == "exact div") for v in ("rsqrt", "exact div")}
        outs = {}
        for v in ("rsqrt", "exact div"):
            h, a = poison_then(fns[("up", v)], *up_args, nbytes=P * 3 * n * 2)
            outs[v] = (np.asarray(h[:rows]), np.asarray(a[:rows]))
        h = outs["rsqrt"][0]
        hf = h.astype(np.float64)
        a_ref = hf[:, :n] * sig64(hf[:, :n]) * hf[:, n:]
        check = dict(
            shape=name, kernel="up",
            h_bitwise=bool(np.array_equal(outs["rsqrt"][0], outs["exact div"][0])),
            finite=bool(np.isfinite(outs["rsqrt"][1].astype(np.float32)).all()),
            a_rel_err_rsqrt=rel(outs["rsqrt"][1], a_ref),
            a_rel_err_exact=rel(outs["exact div"][1], a_ref),
            a_frac_differ=float(np.mean(outs["rsqrt"][1] != outs["exact div"][1])),
        )
        print(json.dumps(check), flush=True)
        rows_out.append(check)
        # dH on the kernel's own H.
        h_full = jax.device_put(np.concatenate([h, np.zeros((P - rows, 2 * n), h.dtype)]))
        dh_args = (go, h_full, plan.token_ids, plan.group_sizes, plan.scores, w2)
        dh_fn = lambda *a: dh_kernel(*a, config=cfg.backward.dh)
        for v in ("rsqrt", "exact div"):
            fns[("dh", v)] = traced(dh_fn, dh_args, v == "exact div")
        dres = {}
        for v in ("rsqrt", "exact div"):
            dh_o, ap, ds = poison_then(fns[("dh", v)], *dh_args, nbytes=P * 3 * n * 2)
            dres[v] = (np.asarray(dh_o[:rows]), np.asarray(ap[:rows]), np.asarray(ds[:rows]))
        check = dict(
            shape=name, kernel="dh",
            finite=bool(all(np.isfinite(o.astype(np.float32)).all() for o in dres["rsqrt"])),
            **{f"{k}_rel_diff": rel(a, b) for k, a, b in
               zip(("dh", "a_scaled", "ds"), dres["rsqrt"], dres["exact div"])},
        )
        print(json.dumps(check), flush=True)
        rows_out.append(check)
        times = {k: [] for k in fns}
        for _ in range(3):
            for k, f in fns.items():
                times[k].append(gpu_time_ms(f, *(up_args if k[0] == "up" else dh_args)) * 1e3)
        for k in fns:
            row = dict(shape=name, kernel=k[0], variant=k[1], us=times[k], best=min(times[k]))
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    print("\n| shape | kernel | exact div (previous) us | rsqrt us | speed-up |")
    print("|---|---|---|---|---|")
    timed = [r for r in rows_out if "best" in r]
    for name in names:
        for kern in ("up", "dh"):
            old = next(r for r in timed if r["shape"] == name and r["kernel"] == kern
                       and r["variant"] == "exact div")
            new = next(r for r in timed if r["shape"] == name and r["kernel"] == kern
                       and r["variant"] == "rsqrt")
            print(f"| {name} | {kern} | {old['best']:.1f} | {new['best']:.1f} | "
                  f"{old['best'] / new['best']:.3f} |")


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(","))
