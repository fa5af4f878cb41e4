"""Session 53: what limits the SmoothQuant CSR kernel at d = 7168 and 7B (issue 13)?

Hypothesis: the f32 smooth-scale row each output row loads (4d bytes from L2, against d
bytes of Q written) makes the kernel L2-bound where the scale table does not fit the SMs'
L1s (d = 7168: 256 experts x 28 KB). Test, same kernel, same instructions, timed paired:
  default    : the plan's experts;
  one-expert : every row's expert 0 (one scale row: L1 hits; wrong Q, only timed);
  no-smooth  : smooth_scales None (no scale loads at all; every row of a token the same Q);
  x_per_row  : `SmoothQuantConfig(x_per_row=True)` (X held in bf16, widened per row: fewer
               registers, more CTAs per SM; the same bits, checked here on poisoned outputs);
  copy       : `v + 1` on P x d bf16 (the copy bound the issue's ratio uses).
Prints one table row per shape and dtype: us and fraction of copy for the bytes moved.
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.forward import gpu_time_ms, interleaved_times_ms  # noqa: E402
from benchmarks.quant import SHAPES, kernel_args, make_case  # noqa: E402
from pallas_moe.quant import SmoothQuantConfig, smoothquant_kernel  # noqa: E402


def main(cases, rounds=3, once=False):
    rows = []
    for name, out_dtype in cases:
        T, d, E, K = SHAPES[name]
        x, smooth, plan = make_case(SHAPES[name], "topk", seed=7)
        P = plan.capacity
        off, rby, rexp, nrows = jax.jit(kernel_args)(plan)
        zexp = jnp.zeros_like(rexp)

        def k(smoothed, config=SmoothQuantConfig()):
            return jax.jit(lambda x, s, o, r, e, n: smoothquant_kernel(
                x, s if smoothed else None, o, r, e, n, num_out_rows=P, out_dtype=out_dtype,
                config=config))

        args = (x, smooth, off, rby, rexp, nrows)
        per_row = k(True, SmoothQuantConfig(x_per_row=True))
        if once:  # for ncu: the default and x_per_row, once each
            jax.block_until_ready(k(True)(*args))
            jax.block_until_ready(per_row(*args))
            continue
        want = jax.block_until_ready(k(True)(*args))
        poison = jnp.full((P * d,), 0x80, jnp.uint8).block_until_ready()
        del poison
        got = jax.block_until_ready(per_row(*args))
        same = all(bool(jnp.all(jax.lax.bitcast_convert_type(a, jnp.uint8 if a.dtype.itemsize == 1 else jnp.uint32)
                                == jax.lax.bitcast_convert_type(b, jnp.uint8 if b.dtype.itemsize == 1 else jnp.uint32)))
                   for a, b in zip(got, want))
        print(f"{name}: x_per_row bitwise equal to the default: {same}", flush=True)
        calls = [(k(True), args),
                 (k(True), (x, smooth, off, rby, zexp, nrows)),
                 (k(False), args),
                 (jax.jit(lambda v: v + 1), (jnp.ones((P, d), jnp.bfloat16),)),
                 (per_row, args)]
        res = interleaved_times_ms(calls, rounds)
        moved = T * d * 2 + P * d * jnp.dtype(out_dtype).itemsize + 4 * P + E * d * 4
        copy_ms = res[3][0]
        copy_bw = 2 * P * d * 2 / copy_ms
        frac = [moved / (r[0]) / copy_bw for r in res]
        line = (f"| {name} | {jnp.dtype(out_dtype).name} | {res[0][0]*1e3:.1f} ({frac[0]:.2f}) "
                f"| {res[1][0]*1e3:.1f} ({frac[1]:.2f}) | {res[2][0]*1e3:.1f} ({frac[2]:.2f}) "
                f"| {copy_ms*1e3:.1f} | {res[4][0]*1e3:.1f} ({frac[4]:.2f}, {res[4][1]:.3f}x) "
                f"| {'yes' if same else 'NO'} | {max(r[2] for r in res):.1%} |")
        print(line, flush=True)
        rows.append(line)
    print("| shape | out | default us (of copy) | one-expert us | no-smooth us | copy us "
          "| x_per_row us (of copy, paired speed-up) | x_per_row bitwise | max spread |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    # cases: "shape" (int8) or "shape:e4m3", comma-separated
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["d7168", "7b", "30b", "d2048"]
    main([(n.split(":")[0], jnp.float8_e4m3fn if n.endswith(":e4m3") else jnp.int8)
          for n in names], once="--once" in sys.argv)
