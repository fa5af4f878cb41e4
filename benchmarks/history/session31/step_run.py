"""Session 31: the whole layer step run untimed, a target for Nsight Compute (which holds
CUPTI, so `step.py`'s timings cannot run under it). Same inputs, config and flags as
`benchmarks/step.py` (`make_step`, `step_inputs`, `CONFIG_FLAGS`).

    PYTHONPATH=. python3 benchmarks/history/session31/step_run.py 7b-n512 [pingpong-up] [--steps 4]

Why: inside the 7b-n512 step the split-M up-proj takes 0.58 ms and the ping-pong 0.54,
while alone (also warm after the router GEMM, after an L2 flush, after 9 ms of matmuls,
with no kernel beside it) split-M is 1.05-1.13x faster. ncu's raw L2 metrics of the up-proj
inside the step, with application replay and no cache control (each pass reruns the whole
program, so the kernel sees the step's real L2 and memory state), against the same kernel
alone, say whether its L2 work changes in the step.
"""
import argparse
import sys

import jax

sys.path.insert(0, ".")
from benchmarks.forward import SHAPES  # noqa: E402
from benchmarks.step import CONFIG_FLAGS, make_step, step_inputs  # noqa: E402
from pallas_moe.kernels import KernelConfig  # noqa: E402


def main():
    # ncu's application replay reruns this program once per metric pass: keep the compiled
    # step between the runs.
    jax.config.update("jax_compilation_cache_dir", "/tmp/step_run_jax_cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    ap = argparse.ArgumentParser()
    ap.add_argument("shape")
    ap.add_argument("flags", nargs="*", help=f"step.py config flags: {sorted(CONFIG_FLAGS)}")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    _, d, n, _, _ = shape
    config = KernelConfig.for_shape(d, n, gather="cp_async")
    for flag in args.flags:
        config = CONFIG_FLAGS[flag](config, n)
    x, router, w1, w2, cot = step_inputs(shape, seed=0)
    step = make_step(shape, "topk", "mosaic", config)
    for _ in range(args.steps):
        jax.block_until_ready(step(x, router, w1, w2, cot.astype(jax.numpy.bfloat16)))
    print("ran", args.steps, "steps of", args.shape, args.flags, flush=True)


if __name__ == "__main__":
    main()
