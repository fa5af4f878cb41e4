"""Session 53: what limits the SmoothQuant CSR kernel at d = 7168 and 7B (issue 13)?

Hypothesis: the f32 smooth-scale row each output row loads (4d bytes from L2, against d
bytes of Q written) makes the kernel L2-bound where the scale table does not fit the SMs'
L1s (d = 7168: 256 experts x 28 KB). Test, same kernel, same instructions, timed paired:
  default    : the plan's experts;
  one-expert : every row's expert 0 (one scale row: L1 hits; wrong Q, only timed);
  no-smooth  : smooth_scales None (no scale loads at all; every row of a token the same Q);
  copy       : `v + 1` on P x d bf16 (the copy bound the issue's ratio uses).
Prints one table row per shape and dtype: us and fraction of copy for the bytes moved.
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.forward import gpu_time_ms, interleaved_times_ms  # noqa: E402
from benchmarks.quant import SHAPES, kernel_args, make_case  # noqa: E402
from pallas_moe.quant import smoothquant_kernel  # noqa: E402


def main(shapes, out_dtype=jnp.int8, rounds=3):
    rows = []
    for name in shapes:
        T, d, E, K = SHAPES[name]
        x, smooth, plan = make_case(SHAPES[name], "topk", seed=7)
        P = plan.capacity
        off, rby, rexp, nrows = jax.jit(kernel_args)(plan)
        zexp = jnp.zeros_like(rexp)

        def k(smoothed):
            return jax.jit(lambda x, s, o, r, e, n: smoothquant_kernel(
                x, s if smoothed else None, o, r, e, n, num_out_rows=P, out_dtype=out_dtype))

        calls = [(k(True), (x, smooth, off, rby, rexp, nrows)),
                 (k(True), (x, smooth, off, rby, zexp, nrows)),
                 (k(False), (x, smooth, off, rby, rexp, nrows)),
                 (jax.jit(lambda v: v + 1), (jnp.ones((P, d), jnp.bfloat16),))]
        res = interleaved_times_ms(calls, rounds)
        moved = T * d * 2 + P * d * jnp.dtype(out_dtype).itemsize + 4 * P + E * d * 4
        copy_ms = res[3][0]
        copy_bw = 2 * P * d * 2 / copy_ms
        frac = [moved / (r[0]) / copy_bw for r in res[:3]]
        line = (f"| {name} | {jnp.dtype(out_dtype).name} | {res[0][0]*1e3:.1f} ({frac[0]:.2f}) "
                f"| {res[1][0]*1e3:.1f} ({frac[1]:.2f}) | {res[2][0]*1e3:.1f} ({frac[2]:.2f}) "
                f"| {copy_ms*1e3:.1f} | {max(r[2] for r in res):.1%} |")
        print(line, flush=True)
        rows.append(line)
    print("| shape | out | default us (of copy) | one-expert us | no-smooth us | copy us | max spread |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["d7168", "7b", "30b", "d2048"])
