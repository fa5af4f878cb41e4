"""Session 21: the persistent dH's epilogue tiles, same run (H100/H200): the default untiled
tiles against 128-byte-swizzled slabs with H loaded by the TMA ladder (session 19's layout)
and by the consumers' own cp.async loads (`DHConfig.epilogue_layout`, `h_loader`).
Bitwise outputs on poisoned buffers (dH, A', dS), the error of dH against a jnp dSwiGLU, and
CUPTI time in alternating rounds.

    PYTHONPATH=. python3 benchmarks/history/session21/dh_epilogue_ab.py 7b,qwen3-30b-a3b[+skew] [short]

At d >= 4096 (one CTA per tile by default) the persistent kernel is forced for the other
rows; `short` leaves out the TMA-loaded swizzled slabs. The ratio column is against the
first row of each shape; "bitwise" compares with it.
"""
import dataclasses
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

rows_out = []
for name in sys.argv[1].split(","):
    shape = SHAPES[name.removesuffix("+skew")]
    T, d, n, E, K = shape
    x, w1, w2, plan, go = make_case(shape, seed=13, skew=name.endswith("+skew"))
    h = (jax.random.normal(jax.random.key(4), (plan.capacity, 2 * n), jnp.float32)
         ).astype(jnp.bfloat16)
    default = BackwardConfig.for_shape(d, n).dh
    cfgs = {}
    if default.persistent_ctas:  # the persistent kernel's epilogue before session 21
        base = dataclasses.replace(default, epilogue_layout="untiled", h_loader="tma")
    else:  # d >= 4096: one CTA per tile by default; the persistent kernel as an option
        cfgs["one CTA per tile (default)"] = default
        base = dataclasses.replace(default, persistent_ctas=132, early_h=False,
                                   gather_completion="wait_group")
    cfgs["untiled (default)" if default.persistent_ctas else "persistent, untiled"] = base
    if sys.argv[2:] != ["short"]:
        cfgs["swizzled, H by TMA"] = dataclasses.replace(base, epilogue_layout="swizzled")
    cfgs["swizzled, H by cp.async"] = dataclasses.replace(base, epilogue_layout="swizzled",
                                                          h_loader="cp_async")
    meta = jax.jit(lambda g, t: _common.tile_meta(g, t, base.block_m))(plan.group_sizes,
                                                                        plan.token_ids)
    args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    fns = {k: jax.jit(lambda *a, c=c: dh_kernel(*a, config=c, meta=meta)) for k, c in cfgs.items()}
    rows = int(plan.num_rows)
    outs = {}
    for k, f in fns.items():
        junk = jnp.full((plan.capacity * 3 * n * 2,), 0xFF, jnp.uint8).block_until_ready()
        del junk  # fresh outputs start as NaN
        try:
            o = jax.block_until_ready(f(*args))
        except Exception as e:  # noqa: BLE001
            print(f"{name} {k}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        outs[k] = [np.asarray(o[0][:rows]), np.asarray(o[1][:rows]), np.asarray(o[2])]
    first = next(iter(outs), None)
    ref = outs.get(first)
    sl = slice(0, max(8, min(rows, 1024, (1 << 29) // (n * d))))  # the f32 einsum fits
    tok = np.asarray(plan.token_ids)[sl]
    ex = np.searchsorted(np.cumsum(np.asarray(plan.group_sizes)), np.arange(sl.stop), side="right")
    da = jnp.einsum("rd,rnd->rn", go[tok].astype(jnp.float32), w2[ex].astype(jnp.float32))
    want_dh = dswiglu(h[sl].astype(jnp.float32), plan.scores[sl][:, None] * da)
    times = {k: [] for k in outs}
    for _ in range(3):
        for k in outs:
            times[k].append(gpu_time_ms(fns[k], *args, iters=10) * 1e3)
    t0 = statistics.median(times[first]) if ref is not None else float("nan")
    for k, o in outs.items():
        same = ref is not None and all(np.array_equal(a, b) for a, b in zip(ref, o))
        finite = all(np.all(np.isfinite(a.astype(np.float32))) for a in o)
        err = float(jnp.linalg.norm(o[0][sl].astype(np.float32) - want_dh)
                    / jnp.linalg.norm(want_dh))
        t = statistics.median(times[k])
        line = (f"| {name} | {k} | {t:.1f} | {t0 / t:.3f} | {same} | {finite} | {err:.2e} | "
                f"{' '.join(f'{v:.1f}' for v in times[k])} |")
        print(line, flush=True)
        rows_out.append(line)
print("\n| shape | dH epilogue | us (median of 3 rounds) | speed-up | bitwise = default | "
      "finite | dH rel err vs jnp | rounds |")
print("|---|---|---|---|---|---|---|---|")
print("\n".join(rows_out))
