"""Session 27: the weight gradients with the cp.async gather's id loads and addresses issued
before its copies (`_common._CP_ASYNC_SOURCES_FIRST`, new) against interleaved with them
(as before), same run, the H200's default configs; outputs must be bitwise equal. Call 8
ran it at commit b742280; the switch (and timeline.py's `inlineids` variant, which ran the
up-proj and dH rows) was removed after it, the new order being the only one.

    PYTHONPATH=. python3 benchmarks/history/session27/gather_order.py 7b
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import SHAPES, gpu_time_ms
from benchmarks.history.session25.wg_run import inputs
from benchmarks.timeline import _patched
from pallas_moe.kernels import _common
from pallas_moe.kernels import weight_grad as wg
from pallas_moe.kernels.moe_backward import BackwardConfig


def main(names):
    print("| shape | kernel | ids inline us | ids first us | speed-up | bitwise |")
    print("|---|---|---|---|---|---|")
    for name in names:
        _, d, n, _, _ = SHAPES[name]
        plan, x, go, dh, ap = inputs(name)
        cfg = BackwardConfig.for_shape(d, n, device_kind="NVIDIA H200")
        for kernel, gathered, lhs, rhs, c in (("dW1", "lhs", x, dh, cfg.dw_gate_up),
                                              ("dW2", "rhs", ap, go, cfg.dw_down)):
            times, outs = {}, {}
            for first in (False, True):
                with _patched(_common, "_CP_ASYNC_SOURCES_FIRST", first):
                    f = jax.jit(lambda l, r, tok, g, c=c, gathered=gathered: wg.weight_grad(
                        l, r, tok, g, gathered=gathered, out_dtype=jnp.bfloat16, config=c))
                    args = (lhs, rhs, plan.token_ids, plan.group_sizes)
                    outs[first] = np.asarray(f(*args)).view(np.uint16)
                    times[first] = 1e3 * gpu_time_ms(f, *args)
            print(f"| {name} | {kernel} | {times[False]:.1f} | {times[True]:.1f} | "
                  f"{times[False] / times[True]:.3f} | {np.array_equal(outs[False], outs[True])} |",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["7b"])
