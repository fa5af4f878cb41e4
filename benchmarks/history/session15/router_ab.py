"""Session 15: the bf16 router's backward as a bf16 layer's (`pm.nn.functional.bf16_linear`:
the logits' gradient rounded to bf16, bf16 GEMMs) against the previous plain `jnp.dot`
(fp32 gradient straight through the rounding), inside the whole layer step.

    PYTHONPATH=. python3 benchmarks/history/session15/router_ab.py [7b,30b]

Same process, same inputs; four rounds in rotating order (CUPTI GPU time of one step), then
each variant's kernel breakdown. The forward output must be bitwise equal (the logits
are); the gradients of x and the router differ by the cotangent's bf16 rounding.
"""
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks import step as step_mod
from benchmarks.forward import SHAPES, gpu_time_ms
from pallas_moe.nn import functional
from pallas_moe.numerics import round_bf16


def previous_router_logits(x, router, bias=None, *, dtype="float32"):
    assert dtype == "bfloat16" and bias is None
    return round_bf16(jnp.dot(x.astype(jnp.bfloat16), router.astype(jnp.bfloat16),
                              preferred_element_type=jnp.float32))


@jax.custom_vjp
def _bf16_out_linear(x, w):
    return functional.bf16_linear(x, w)


def _bf16_out_fwd(x, w):
    return functional.bf16_linear(x, w), (x, w)


def _bf16_out_bwd(res, grad):  # as bf16_linear, but dx leaves the GEMM in x's dtype
    x, w = res
    g = grad.astype(jnp.bfloat16)
    dx = jnp.dot(g, w.astype(jnp.bfloat16).T, preferred_element_type=x.dtype)
    dw = jnp.dot(x.astype(jnp.bfloat16).T, g, preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype)


_bf16_out_linear.defvjp(_bf16_out_fwd, _bf16_out_bwd)


def bf16_out_router_logits(x, router, bias=None, *, dtype="float32"):
    assert dtype == "bfloat16" and bias is None
    return _bf16_out_linear(x, router)


def rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def main(names):
    rows = []
    for name in names:
        shape = SHAPES[name]
        x, router, w1, w2, cot = step_mod.step_inputs(shape, 15)
        args = (x, router, w1, w2, cot.astype(jnp.bfloat16))  # as benchmarks/step.py passes it
        fns, outs = {}, {}
        for label, fn in (("jnp.dot (previous)", previous_router_logits),
                          ("bf16_linear", functional.router_logits),
                          ("bf16_linear, dx in bf16", bf16_out_router_logits)):
            step_mod.router_logits = fn  # read when the step is traced, just below
            f = step_mod.make_step(shape, "topk", "mosaic", None, router_dtype="bfloat16")
            outs[label] = jax.block_until_ready(f(*args))
            fns[label] = f
        o0, g0 = outs["jnp.dot (previous)"]
        for label, (o1, g1) in outs.items():
            check = dict(shape=name, variant=label, out_bitwise=bool(jnp.array_equal(o0, o1)),
                         rel_dx=rel(g1[0], g0[0]), rel_drouter=rel(g1[1], g0[1]),
                         rel_dw1=rel(g1[2], g0[2]), rel_dw2=rel(g1[3], g0[3]))
            print(json.dumps(check), flush=True)
        times = {k: [] for k in fns}
        labels = list(fns)
        for r in range(4):  # the order rotates: no variant always runs first or last
            for k in labels[r % 3:] + labels[:r % 3]:
                times[k].append(gpu_time_ms(fns[k], *args))
        for k, f in fns.items():
            br = step_mod.kernel_breakdown(f, *args)
            row = dict(shape=name, variant=k, ms=times[k], best=min(times[k]),
                       breakdown_sum_us=round(sum(ms for _, ms, _ in br) * 1e3, 1),
                       kernels=[(n, round(ms * 1e3, 1), c) for n, ms, c in br][:16])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| shape | variant | step GPU ms (4 rounds) | best | one step's kernels, summed us |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {' / '.join(f'{m:.3f}' for m in r['ms'])} | "
              f"{r['best']:.3f} | {r['breakdown_sum_us']} |")


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(","))
