"""Session 23: the persistent weight-gradient kernels (`WeightGradConfig.persistent_ctas`)
on the GPU: bitwise against the one-CTA-per-item kernel (the GPU-verified default) and
against an XLA reference, with poisoned outputs and NaN padding rows in the contiguous
operand; then CUPTI times against the default, the default at 3 stages, and a same-run
batched matmul of the same FLOPs.

    PYTHONPATH=. python3 benchmarks/history/session23/wg_persistent.py [7b,30b,7b-skew] [--direct]

`--direct` (call 6; first `git apply
benchmarks/history/session23/wg_direct_stores_experiment.patch`, which also makes the masking
load `optimized=True`, as calls 5 and 6 ran it): the persistent kernel with 4 stages and its
output tiles stored straight from registers (`weight_grad._DIRECT_STORES`, no SMEM tile),
instead of the 3-stage row. Measured slower (0.92-0.95x at 7B); not kept.

`--output-chunks` (added in session 24 for its next session): also the persistent kernel with
4 stages beside one output buffer per consumer (`WeightGradConfig.output_chunks=1`).
"""
import dataclasses
import sys

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms, poison_then
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.kernels.moe_forward import default_num_sms
from pallas_moe.kernels import weight_grad as wg
from pallas_moe.kernels.weight_grad import k_block_meta, weight_grad
from pallas_moe.routing.topk import topk_plan

DIRECT = "--direct" in sys.argv
OUTPUT_CHUNKS = "--output-chunks" in sys.argv
SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8),
          "7b-skew": (24576, 1536, 256, 128, 8)}


def reference(l_rows, r_rows, plan, num_experts, max_rows):
    """out[e] = L[rows e]^T R[rows e] in f32, one expert per scan step over a masked window."""
    sizes = plan.group_sizes
    lo = jnp.cumsum(sizes) - sizes
    rows = jnp.arange(max_rows)

    def one(_, e):
        idx = jnp.minimum(lo[e] + rows, l_rows.shape[0] - 1)
        keep = (rows < sizes[e])[:, None]
        lw = jnp.where(keep, l_rows[idx].astype(jnp.float32), 0)
        rw = jnp.where(keep, r_rows[idx].astype(jnp.float32), 0)
        return None, lw.T @ rw

    return jax.lax.scan(one, None, jnp.arange(num_experts))[1]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(names):
    rows = []
    sms = default_num_sms()
    for name in names:
        T, d, n, E, K = SHAPES[name]
        ks = jax.random.split(jax.random.key(len(rows) + 5), 5)
        logits = jax.random.normal(ks[0], (T, E), jnp.float32)
        if name.endswith("skew"):  # a quarter of the experts preferred, three empty
            logits = logits + jnp.where(jnp.arange(E) < E // 4, 1.5, 0.0)
            logits = logits.at[:, E - 3:].set(-1e4)
        plan = jax.jit(lambda l: topk_plan(l, K, score="softmax_topk"))(logits)
        P = plan.capacity
        p64 = -(-P // 64) * 64
        x = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
        go = jax.random.normal(ks[2], (T, d), jnp.bfloat16)
        nan_pad = lambda a: jnp.concatenate(  # noqa: E731  padding rows poisoned
            [a, jnp.full((p64 - P, a.shape[1]), jnp.nan, a.dtype)]) if p64 > P else a
        dh = nan_pad(jax.random.normal(ks[3], (P, 2 * n), jnp.bfloat16))
        ap = nan_pad(jax.random.normal(ks[4], (P, n), jnp.bfloat16))
        meta = jax.jit(lambda g, t: k_block_meta(g, t, 64))(plan.group_sizes, plan.token_ids)
        sizes = np.asarray(plan.group_sizes)
        print(f"== {name} groups [{sizes.min()}, {sizes.max()}], empty {int((sizes == 0).sum())}",
              flush=True)
        cfg = BackwardConfig.for_shape(d, n)
        m = P // E
        bmm = jax.jit(lambda a, b: jnp.einsum("emk,ekn->emn", a, b))
        for kname, gathered, l, r, base, bound_shapes in (
                ("dW1", "lhs", x, dh, cfg.dw_gate_up, ((E, d, m), (E, m, 2 * n))),
                ("dW2", "rhs", ap, go, cfg.dw_down, ((E, n, m), (E, m, d)))):
            variants = {
                "default": base,
                "3 stages": dataclasses.replace(base, num_stages=3),
                "persistent, 3 stages": dataclasses.replace(base, num_stages=3,
                                                            persistent_ctas=sms),
            }
            if OUTPUT_CHUNKS:  # session 24: 4 stages, one output buffer per consumer
                variants["persistent, 4 stages, output_chunks=1"] = dataclasses.replace(
                    base, persistent_ctas=sms, output_chunks=1)
            if DIRECT:  # call 6: output tiles stored from registers, no SMEM tile
                variants = {v: c for v, c in variants.items() if v != "3 stages"}
                variants["persistent, 4 stages, direct stores"] = dataclasses.replace(
                    base, persistent_ctas=sms)
            fns = {v: jax.jit(lambda l, r, t, g, c=c, gathered=gathered: weight_grad(
                l, r, t, g, gathered=gathered, out_dtype=jnp.bfloat16, config=c, meta=meta))
                for v, c in variants.items()}
            args = (l, r, plan.token_ids, plan.group_sizes)
            nbytes = E * l.shape[1] * r.shape[1] * 2
            outs = {}
            for v, f in fns.items():  # traced (and compiled) here
                wg._DIRECT_STORES = "direct" in v
                outs[v] = np.asarray(poison_then(f, *args, nbytes=nbytes))
            wg._DIRECT_STORES = False
            l_rows = x[plan.token_ids] if gathered == "lhs" else ap[:P]
            r_rows = dh[:P] if gathered == "lhs" else go[plan.token_ids]
            ref = jax.jit(reference, static_argnums=(3, 4))(l_rows, r_rows, plan, E,
                                                            int(sizes.max()))
            last = list(outs)[-1]
            err = rel(outs[last].astype(np.float32), ref)
            bitwise = all(np.array_equal(outs["default"], o) for o in outs.values())
            finite = bool(np.isfinite(outs[last].astype(np.float32)).all())
            repeat = np.array_equal(np.asarray(fns[last](*args)), outs[last])
            print(f"  {kname}: rel err vs XLA {err:.2e}, bitwise equal to default {bitwise}, "
                  f"finite {finite}, bitwise repeat {repeat}", flush=True)
            ka, kb = jax.random.split(jax.random.key(7))
            bound = gpu_time_ms(bmm, jax.random.normal(ka, bound_shapes[0], jnp.bfloat16),
                           jax.random.normal(kb, bound_shapes[1], jnp.bfloat16)) * 1e3
            times = {v: gpu_time_ms(f, *args) * 1e3 for v, f in fns.items()}
            for v, t in times.items():
                rows.append((name, kname, v, t, bound, times["default"], err, bitwise))
                print("  ", rows[-1], flush=True)
    print("\n| shape | kernel | variant | us | bound us | bound / us | default / us | "
          "err vs XLA | bitwise = default |\n|---|---|---|---|---|---|---|---|---|")
    for name, k, v, t, b, t0, err, bw in rows:
        print(f"| {name} | {k} | {v} | {t:.1f} | {b:.1f} | {b / t:.2f} | {t0 / t:.3f} | "
              f"{err:.1e} | {bw} |")


if __name__ == "__main__":
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(names[0].split(",") if names else list(SHAPES))
