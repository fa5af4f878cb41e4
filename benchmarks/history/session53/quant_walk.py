"""Session 53: the SmoothQuant expert walk (`SmoothQuantConfig(expert_chunk=C)`) against
the token walk (the default), paired over 3 rounds, the whole op (with its per-plan
metadata) and the kernel alone, on poisoned outputs checked bitwise against the default.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
import pallas_moe as pm  # noqa: E402
from benchmarks.forward import interleaved_times_ms  # noqa: E402
from benchmarks.quant import SHAPES, make_case  # noqa: E402
from pallas_moe.quant import SmoothQuantConfig  # noqa: E402

CHUNKS = {"d7168": (128, 512, 2048), "7b": (256, 1024, 4096), "30b": (256, 1024, 4096)}


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def main(cases, rounds=3):
    table = []
    for name, out_dtype in cases:
        T, d, E, K = SHAPES[name]
        x, smooth, plan = make_case(SHAPES[name], "topk", seed=5)
        P = plan.capacity
        configs = [SmoothQuantConfig()] + [SmoothQuantConfig(expert_chunk=c) for c in CHUNKS[name]]
        ops = [jax.jit(lambda x, s, p, c=c: pm.quant.moe_smoothquant(
            x, s, p, out_dtype=out_dtype, backend="mosaic", config=c)) for c in configs]
        want = jax.block_until_ready(ops[0](x, smooth, plan))
        ok = []
        for op in ops:
            junk = jnp.full((P * d,), 0x80, jnp.uint8).block_until_ready()
            del junk
            got = jax.block_until_ready(op(x, smooth, plan))
            ok.append(all(np.array_equal(bits(g), bits(w)) for g, w in zip(got, want)))
        res = interleaved_times_ms([(op, (x, smooth, plan)) for op in ops]
                                   + [(jax.jit(lambda v: v + 1), (jnp.ones((P, d), jnp.bfloat16),))],
                                   rounds)
        copy_ms = res[-1][0]
        copy_bw = 2 * P * d * 2 / copy_ms
        moved = T * d * 2 + P * d * jnp.dtype(out_dtype).itemsize + 4 * P + E * d * 4
        for cfg, good, (ms, speedup, spread) in zip(configs, ok, res[:-1]):
            line = (f"| {name} | {jnp.dtype(out_dtype).name} | {cfg.expert_chunk or 'tokens'} "
                    f"| {ms * 1e3:.1f} | {moved / ms / copy_bw:.2f} | {speedup:.3f}x | {spread:.1%} "
                    f"| {'yes' if good else 'NO'} |")
            print(line, flush=True)
            table.append(line)
        print(f"copy {copy_ms * 1e3:.1f} us", flush=True)
    print("| shape | out | walk (chunk) | op us | of copy | paired vs tokens | spread | bitwise |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["d7168", "7b", "30b"]
    main([(n.split(":")[0], jnp.float8_e4m3fn if n.endswith(":e4m3") else jnp.int8)
          for n in names])
