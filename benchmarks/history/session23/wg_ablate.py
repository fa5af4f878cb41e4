"""Session 23: where the weight gradients' per-tile cost goes (timing only: ablations give
wrong outputs). t(T) = fixed + T * per_token at T = 24576 and 12288 (7B widths, same tile
count), for the default kernel and with one step removed:
  oldmask    - the mask's SMEM load unoptimized, as before session 23;
  nomask     - the group-edge K-blocks are not masked (`_mask_foreign_rows` skipped);
  nostore    - the output tile's TMA stores dropped;
  both.
Plus the persistent kernel (3 stages) with and without the masking.

    PYTHONPATH=. python3 benchmarks/history/session23/wg_ablate.py
"""
import contextlib
import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.forward import gpu_time_ms
from pallas_moe.kernels import weight_grad as wg
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.routing.topk import topk_plan


@contextlib.contextmanager
def ablated(what):
    saved = (wg._mask_foreign_rows, plgpu.copy_smem_to_gmem)
    if "nomask" in what:
        wg._mask_foreign_rows = lambda *a, **k: None
    if "oldmask" in what:  # the mask's SMEM load as before session 23 (optimized=False)
        wg._mask_foreign_rows = _unoptimized_mask
    if "nostore" in what:
        plgpu.copy_smem_to_gmem = lambda *a, **k: None
    try:
        yield
    finally:
        wg._mask_foreign_rows, plgpu.copy_smem_to_gmem = saved


def _unoptimized_mask(ref, k0, lo, hi):
    layout = plgpu.Layout.WGMMA
    vals = plgpu.load(ref, layout=layout, optimized=False)
    rows = plgpu.broadcasted_iota(jnp.int32, vals.shape, 0, layout=layout) + k0
    keep = (rows >= lo) & (rows < hi)
    ref[...] = jnp.where(keep, vals, jnp.zeros_like(vals))
    plgpu.commit_smem()


def main():
    d, n, E, K = 1536, 256, 128, 8
    cfg = BackwardConfig.for_shape(d, n)
    rows = []
    for T in (24576, 12288):
        ks = jax.random.split(jax.random.key(T), 4)
        plan = jax.jit(lambda l: topk_plan(l, K, score="softmax_topk"))(
            jax.random.normal(ks[0], (T, E), jnp.float32))
        P = plan.capacity
        p64 = -(-P // 64) * 64
        x = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
        dh = jax.random.normal(ks[2], (p64, 2 * n), jnp.bfloat16)
        ap = jax.random.normal(ks[3], (p64, n), jnp.bfloat16)
        meta = jax.jit(lambda g, t: wg.k_block_meta(g, t, 64))(plan.group_sizes, plan.token_ids)
        for name, gathered, l, r, c in (("dW1", "lhs", x, dh, cfg.dw_gate_up),
                                        ("dW2", "rhs", ap, x, cfg.dw_down)):
            pers = dataclasses.replace(c, num_stages=3, persistent_ctas=132)
            for variant, conf in (("oldmask", c), ("default", c), ("nomask", c), ("nostore", c),
                                  ("nomask+nostore", c), ("persistent", pers),
                                  ("persistent+nomask", pers)):
                with ablated(variant):
                    f = jax.jit(lambda l, r, t, g, conf=conf, gathered=gathered: wg.weight_grad(
                        l, r, t, g, gathered=gathered, out_dtype=jnp.bfloat16, config=conf,
                        meta=meta))
                    t_us = gpu_time_ms(f, l, r, plan.token_ids, plan.group_sizes) * 1e3
                rows.append((T, name, variant, t_us))
                print(rows[-1], flush=True)
    by = {(T, k, v): t for T, k, v, t in rows}
    print("\n| kernel | variant | us at T=24576 | us at T=12288 | fixed = 2 t(T/2) - t(T) |")
    print("|---|---|---|---|---|")
    for _, k, v, _ in rows[: len(rows) // 2]:
        a, b = by[(24576, k, v)], by[(12288, k, v)]
        print(f"| {k} | {v} | {a:.1f} | {b:.1f} | {2 * b - a:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
