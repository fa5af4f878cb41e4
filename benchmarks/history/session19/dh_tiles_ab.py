"""The persistent dH with swizzled epilogue tiles (session 19) against the same kernel with
untiled [bm, bn] tiles (dh.py at e06568a, the code before and after), same run, H100:
bitwise outputs on poisoned buffers and CUPTI time, alternating rounds.

    git apply benchmarks/history/session19/dh_swizzled_tiles_experiment.patch
    PYTHONPATH=. python3 benchmarks/history/session19/dh_tiles_ab.py 7b,30b
"""
import dataclasses
import importlib.util
import os
import statistics
import sys

import numpy as np

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.backward import make_case  # noqa: E402
from benchmarks.forward import SHAPES, gpu_time_ms  # noqa: E402
from pallas_moe.kernels import _common  # noqa: E402
from pallas_moe.kernels.dh import dh_kernel  # noqa: E402
from pallas_moe.kernels.moe_backward import BackwardConfig  # noqa: E402
from pallas_moe.ops.minimal_backward import dswiglu  # noqa: E402

import subprocess  # noqa: E402
import tempfile  # noqa: E402

_untiled = os.path.join(tempfile.mkdtemp(), "dh_untiled.py")
with open(_untiled, "w") as fh:  # the untiled kernel, as committed before the experiment
    fh.write(subprocess.run(["git", "show", "e06568a:pallas_moe/kernels/dh.py"],
                            capture_output=True, text=True, check=True).stdout)
spec = importlib.util.spec_from_file_location("dh_untiled", _untiled)
old = importlib.util.module_from_spec(spec)
sys.modules["dh_untiled"] = old  # dataclasses look their module up there
spec.loader.exec_module(old)

rows_out = []
for name in sys.argv[1].split(","):
    shape = SHAPES[name]
    T, d, n, E, K = shape
    x, w1, w2, plan, go = make_case(shape, seed=11)
    h = (jax.random.normal(jax.random.key(3), (plan.capacity, 2 * n), jnp.float32)
         ).astype(jnp.bfloat16)
    base = BackwardConfig.for_shape(d, n).dh
    cfg = dataclasses.replace(base, persistent_ctas=132, early_h=False,
                              gather_completion="wait_group")
    meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.block_m))(plan.group_sizes,
                                                                       plan.token_ids)
    args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    variants = {
        "untiled": jax.jit(lambda *a: old.dh_kernel(*a, config=cfg, meta=meta)),
        "tiled": jax.jit(lambda *a: dh_kernel(*a, config=cfg, meta=meta)),
    }
    if base.persistent_ctas == 0:
        variants["default (one CTA per tile)"] = jax.jit(
            lambda *a: dh_kernel(*a, config=base, meta=meta))
    rows = int(plan.num_rows)
    outs = {}
    for k, f in variants.items():
        junk = jnp.full((plan.capacity * 3 * n * 2,), 0xFF, jnp.uint8).block_until_ready()
        del junk
        o = jax.block_until_ready(f(*args))
        outs[k] = [np.asarray(o[0][:rows]), np.asarray(o[1][:rows]), np.asarray(o[2])]
    same = all(np.array_equal(a, b) for a, b in zip(outs["untiled"], outs["tiled"]))
    finite = all(np.all(np.isfinite(a.astype(np.float32))) for a in outs["tiled"])
    # Against the jnp dSwiGLU of the same dA' (dO gathered @ W2^T in f32).
    sl = slice(0, min(rows, 1024))
    tok = np.asarray(plan.token_ids)[sl]
    ex = np.searchsorted(np.cumsum(np.asarray(plan.group_sizes)), np.arange(sl.stop), side="right")
    da = jnp.einsum("rd,rnd->rn", go[tok].astype(jnp.float32), w2[ex].astype(jnp.float32))
    want_dh = dswiglu(h[sl].astype(jnp.float32), plan.scores[sl][:, None] * da)
    err = float(jnp.linalg.norm(outs["tiled"][0][sl].astype(np.float32) - want_dh)
                / jnp.linalg.norm(want_dh))
    times = {k: [] for k in variants}
    for _ in range(3):
        for k, f in variants.items():
            times[k].append(gpu_time_ms(f, *args, iters=10) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    line = (f"| {name} | {med['untiled']:.1f} | {med['tiled']:.1f} | "
            f"{med['untiled'] / med['tiled']:.3f} | "
            + (f"{med['default (one CTA per tile)']:.1f} | " if "default (one CTA per tile)" in med else "- | ")
            + f"{same} | {finite} | {err:.2e} |")
    print(line, flush=True)
    rows_out.append(line)
print("| shape | persistent, untiled tiles us | persistent, swizzled tiles us | speed-up | "
      "one CTA per tile (default at d >= 4096) us | bitwise equal | finite | dH rel err vs jnp |")
print("|---|---|---|---|---|---|---|---|")
print("\n".join(rows_out))
