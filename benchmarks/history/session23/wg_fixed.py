"""Session 23: how much of the weight-gradient kernels' time is per-tile (fixed) cost.

The weight gradients launch one CTA per (expert, output tile) whatever the token count, and
each walks its expert's rows. Timing them at T, T/2 and T/4 (same widths, same tile count)
splits t(T) = fixed + T * per_token: fixed = 2 t(T/2) - t(T). The fixed part is what a
persistent kernel (next tile's first K steps loading under this tile's epilogue) could hide.
`nostore` drops the output tile's TMA stores (timing only). A same-run batched matmul of the
same FLOPs (balanced groups) is the bound.

    PYTHONPATH=. python3 benchmarks/history/session23/wg_fixed.py
"""
import contextlib
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.forward import gpu_time_ms
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.kernels.weight_grad import k_block_meta, weight_grad
from pallas_moe.routing.topk import topk_plan


@contextlib.contextmanager
def nostore():
    saved = plgpu.copy_smem_to_gmem
    plgpu.copy_smem_to_gmem = lambda *a, **k: None
    try:
        yield
    finally:
        plgpu.copy_smem_to_gmem = saved


def main():
    d, n, E, K = 1536, 256, 128, 8
    cfg = BackwardConfig.for_shape(d, n)
    rows = []
    for T in (24576, 12288, 6144):
        ks = jax.random.split(jax.random.key(T), 4)
        plan = jax.jit(lambda l: topk_plan(l, K, score="softmax_topk"))(
            jax.random.normal(ks[0], (T, E), jnp.float32))
        P = plan.capacity
        p64 = -(-P // 64) * 64
        x = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
        dh = jax.random.normal(ks[2], (p64, 2 * n), jnp.bfloat16)
        ap = jax.random.normal(ks[3], (p64, n), jnp.bfloat16)
        meta = jax.jit(lambda g, t: k_block_meta(g, t, 64))(plan.group_sizes, plan.token_ids)
        m = P // E
        bmm = jax.jit(lambda a, b: jnp.einsum("emk,ekn->emn", a, b))
        bound1 = gpu_time_ms(bmm, jnp.ones((E, d, m), jnp.bfloat16), jnp.ones((E, m, 2 * n), jnp.bfloat16))
        bound2 = gpu_time_ms(bmm, jnp.ones((E, n, m), jnp.bfloat16), jnp.ones((E, m, d), jnp.bfloat16))
        for name, gathered, l, r, c, bound in (
                ("dW1", "lhs", x, dh, cfg.dw_gate_up, bound1),
                ("dW2", "rhs", ap, x, cfg.dw_down, bound2)):
            for variant in ("", "nostore"):
                with (nostore() if variant else contextlib.nullcontext()):
                    f = jax.jit(lambda l, r, t, g, c=c, gathered=gathered: weight_grad(
                        l, r, t, g, gathered=gathered, out_dtype=jnp.bfloat16, config=c,
                        meta=meta))
                    t_ms = gpu_time_ms(f, l, r, plan.token_ids, plan.group_sizes)
                rows.append((T, name + ("+" + variant if variant else ""), t_ms * 1e3,
                             bound * 1e3))
                print(rows[-1], flush=True)
    print("\n| T | kernel | us | dense bound us | bound / kernel |\n|---|---|---|---|---|")
    for T, name, t, b in rows:
        print(f"| {T} | {name} | {t:.1f} | {b:.1f} | {b / t:.2f} |")
    by = {(T, k): t for T, k, t, _ in rows}
    print("\n| kernel | fixed = 2 t(T/2) - t(T), us (24576 / 12288) | per-token share at T=24576 |")
    print("|---|---|---|")
    for k in sorted({k for _, k, _, _ in rows}):
        f1 = 2 * by[(12288, k)] - by[(24576, k)]
        f2 = 2 * by[(6144, k)] - by[(12288, k)]
        print(f"| {k} | {f1:.1f} / {f2:.1f} | {by[(24576, k)] - f1:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
