"""Session 25: where the persistent 4-stage weight gradients' time goes (the H200's default
since this session; at 30B 0.68 of the dense bound, Nsight Compute finding no resource at its
ceiling). Timing only (ablations give wrong outputs), CUPTI us, same run, per shape and
kernel (dW1 = X[tok]^T dH, dW2 = A'^T dO[tok]):
  default  - the kernel;
  nomask   - group-edge K-blocks not masked (`weight_grad._mask_foreign_rows` skipped);
  nostore  - no output TMA stores;
  nomma    - no wgmma (the consumers still wait for and release every stage): the feed alone;
  nofeed   - no operand loads (`timeline.no_feed`: TMA copies arrive without data, the cp.async
             gather issues nothing; token ids still load): the wgmmas alone.
If nomma and nofeed are each well under default, the two halves contend as the up-proj's did
before its ring streamed across items (session 24); if default sits near nomma, the feed
bounds it.

    PYTHONPATH=. python3 benchmarks/history/session25/wg_ablate.py 7b,30b
"""
import contextlib
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.forward import SHAPES, gpu_time_ms
from benchmarks.history.session25.wg_run import inputs
from benchmarks.timeline import _patched, no_feed
from pallas_moe.kernels import weight_grad as wg
from pallas_moe.kernels.moe_backward import BackwardConfig

ABLATIONS = {
    "default": contextlib.nullcontext,
    "nomask": lambda: _patched(wg, "_mask_foreign_rows", lambda *a, **k: None),
    "nostore": lambda: _patched(plgpu, "copy_smem_to_gmem", lambda *a, **k: None),
    "nomma": lambda: _patched(plgpu, "wgmma", lambda *a, **k: None),
    "nofeed": no_feed,
}


def main(names):
    rows = []
    for name in names:
        _, d, n, _, _ = SHAPES[name]
        plan, x, go, dh, ap = inputs(name)
        cfg = BackwardConfig.for_shape(d, n, device_kind="NVIDIA H200")  # persistent, 4 stages
        for kernel, gathered, lhs, rhs, c in (("dW1", "lhs", x, dh, cfg.dw_gate_up),
                                              ("dW2", "rhs", ap, go, cfg.dw_down)):
            times = {}
            for what, ctx in ABLATIONS.items():
                with ctx():
                    f = jax.jit(lambda l, r, tok, g, c=c, gathered=gathered: wg.weight_grad(
                        l, r, tok, g, gathered=gathered, out_dtype=jnp.bfloat16, config=c))
                    times[what] = 1e3 * gpu_time_ms(f, lhs, rhs, plan.token_ids,
                                                    plan.group_sizes)
            print(name, kernel, c, {w: round(v, 1) for w, v in times.items()}, flush=True)
            rows.append((name, kernel, times))
    print("| shape | kernel | " + " | ".join(ABLATIONS) + " |")
    print("|---|---|" + "---|" * len(ABLATIONS))
    for name, kernel, times in rows:
        print(f"| {name} | {kernel} | " + " | ".join(f"{times[w]:.1f}" for w in ABLATIONS) + " |")


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["7b", "30b"])
