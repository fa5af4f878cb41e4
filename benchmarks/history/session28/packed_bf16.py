"""Session 28, prepared for the next GPU run: are `timeline.packed_bf16_conversions`'s kernels
(every f32 -> bf16 conversion of a two-element register as one `cvt.rn.bf16x2.f32`) the same
bits as the library's? The whole op, forward and the four gradients (`moe_ffn` with
`backend="mosaic"`, top-K, the device's defaults), with and without the patch, on fresh
random data; prints one line per output and fails if any differs.

    PYTHONPATH=. python3 benchmarks/history/session28/packed_bf16.py [7b,30b,d2048]

On a CPU host it lowers the 7B case for cuda both ways instead (a check that the patch
traces; it cannot run the kernels)."""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
import pallas_moe as pm  # noqa: E402
from benchmarks.forward import SHAPES  # noqa: E402
from benchmarks.timeline import packed_bf16_conversions  # noqa: E402

SHAPES = {**SHAPES, "d2048": (8192, 2048, 768, 128, 8)}


def case(name):
    T, d, n, E, K = SHAPES[name]
    ks = jax.random.split(jax.random.key(T + d + n), 6)
    x = jax.random.normal(ks[0], (T, d), jnp.float32).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[1], (T, E), jnp.float32)
    w1 = (jax.random.normal(ks[2], (E, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (E, n, d)) * n**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(ks[4], (T, d), jnp.float32).astype(jnp.bfloat16)
    return (logits, x, w1, w2, cot), K


def step_fn(K):
    def loss(logits, x, w1, w2, cot):
        out = pm.moe_ffn(x, pm.routing.topk_plan(logits, K), w1, w2, backend="mosaic")
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    # A new function object per call: jit's trace cache must not reuse the other form.
    return jax.jit(jax.value_and_grad(lambda *a: loss(*a), argnums=(0, 1, 2, 3), has_aux=True))


def main():
    names = (sys.argv[1] if len(sys.argv) > 1 else "7b,30b,d2048").split(",")
    if jax.devices()[0].platform != "gpu":
        from tests.cuda_target import h100_target

        args, K = case("7b")
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        with h100_target():
            base = step_fn(K).trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()
            with packed_bf16_conversions():
                packed = step_fn(K).trace(*abstract).lower(lowering_platforms=("cuda",)).as_text()
        print(f"lowered: {'bf16x2' in packed and 'bf16x2' not in base} (cvt.rn.bf16x2 only in "
              f"the patched step; {len(base)} / {len(packed)} characters)")
        return
    failed = []
    for name in names:
        args, K = case(name)
        (_, out), grads = step_fn(K)(*args)
        with packed_bf16_conversions():
            (_, out_p), grads_p = step_fn(K)(*args)
        for what, a, b in zip(("out", "d_logits", "dx", "dw_gate_up", "dw_down"),
                              (out, *grads), (out_p, *grads_p)):
            same = bool(jnp.array_equal(a, b))
            print(f"{name} {what}: {'bitwise equal' if same else 'DIFFERS'}", flush=True)
            if not same:
                failed.append(f"{name} {what}")
    if failed:
        raise SystemExit(f"packed conversions changed: {failed}")


if __name__ == "__main__":
    main()
