"""Session 15: sum the router's and the experts' dx in one place (issue 9, `wrapped_add`).

    PYTHONPATH=. python3 benchmarks/history/session15/router_tee.py [7b,30b]

x reaches the router and the experts; JAX adds the two cotangents in a separate kernel
(`wrapped_add`, 76 us at 7B). Here a `custom_vjp` "tee" returns (logits, x): the experts
consume its second output, so its backward receives both cotangents and computes
`dx = g W^T + dx_experts` itself, for XLA to fuse into the GEMM. Variants: the library's
layer (`bf16_linear`, separate add), the tee adding in fp32 (one rounding), the tee adding
in bf16. Four rounds in rotating order, then each variant's kernel breakdown.
"""
import json
import sys

import jax
import jax.numpy as jnp

import pallas_moe as pm
from benchmarks import step as step_mod
from benchmarks.forward import SHAPES, gpu_time_ms
from pallas_moe.nn import functional


def make_tee(add_in_f32: bool):
    @jax.custom_vjp
    def tee(x, w):
        return functional.bf16_linear(x, w), x

    def fwd(x, w):
        return tee(x, w), (x, w)

    def bwd(res, cts):
        x, w = res
        g_logits, dx_experts = cts
        g = g_logits.astype(jnp.bfloat16)
        wt = w.astype(jnp.bfloat16).T
        if add_in_f32:
            dx = (jnp.dot(g, wt, preferred_element_type=jnp.float32)
                  + dx_experts.astype(jnp.float32)).astype(x.dtype)
        else:
            dx = jnp.dot(g, wt, preferred_element_type=x.dtype) + dx_experts
        dw = jnp.dot(x.astype(jnp.bfloat16).T, g, preferred_element_type=jnp.float32)
        return dx, dw.astype(w.dtype)

    tee.defvjp(fwd, bwd)
    return tee


def make_tee_step(shape, tee):
    _, _, _, _, k = shape

    def layer(x, router, w1, w2):
        logits, x_experts = tee(x, router)
        plan = pm.routing.topk_plan(logits, k)
        return pm.moe_ffn(x_experts, plan, w1, w2, backend="mosaic")

    def step(x, router, w1, w2, cot):
        out, pullback = jax.vjp(layer, x, router, w1, w2)
        return out, pullback(cot.astype(out.dtype))

    return jax.jit(step)


def rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def main(names):
    rows = []
    for name in names:
        shape = SHAPES[name]
        x, router, w1, w2, cot = step_mod.step_inputs(shape, 15)
        args = (x, router, w1, w2, cot.astype(jnp.bfloat16))
        fns = {"bf16_linear + add (library)": step_mod.make_step(
                   shape, "topk", "mosaic", None, router_dtype="bfloat16"),
               "tee, fp32 add": make_tee_step(shape, make_tee(True)),
               "tee, bf16 add": make_tee_step(shape, make_tee(False))}
        outs = {k: jax.block_until_ready(f(*args)) for k, f in fns.items()}
        o0, g0 = outs["bf16_linear + add (library)"]
        for k, (o1, g1) in outs.items():
            print(json.dumps(dict(shape=name, variant=k, out_bitwise=bool(jnp.array_equal(o0, o1)),
                                  rel_dx=rel(g1[0], g0[0]), rel_drouter=rel(g1[1], g0[1]))),
                  flush=True)
        times = {k: [] for k in fns}
        labels = list(fns)
        for r in range(4):
            for k in labels[r % 3:] + labels[:r % 3]:
                times[k].append(gpu_time_ms(fns[k], *args))
        for k, f in fns.items():
            br = step_mod.kernel_breakdown(f, *args)
            row = dict(shape=name, variant=k, ms=times[k],
                       breakdown_sum_us=round(sum(ms for _, ms, _ in br) * 1e3, 1),
                       kernels=[(n, round(ms * 1e3, 1), c) for n, ms, c in br][7:14])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| shape | variant | step GPU ms (4 rounds) | one step's kernels, summed us |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {' / '.join(f'{m:.3f}' for m in r['ms'])} | "
              f"{r['breakdown_sum_us']} |")


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(","))
