"""Which XLA step of the int8 forward (`moe_ffn_fp8(backend="xla")`) differs between the
H100 and the CPU (call 1: the outputs differ by 0.98%, the int8 ragged_dot is exact on
both)? Each stage runs on both devices from the same (CPU-computed) inputs.

    PYTHONPATH=. python3 benchmarks/history/session19/int8_xla_stages.py
"""
import numpy as np

import jax
import jax.numpy as jnp

import pallas_moe as pm
from pallas_moe.kernels.reference import fp8_epilogue_reference, fp8_grouped_matmul_reference
from pallas_moe.ops.xla import aggregate_rows
from pallas_moe.quant import ffn
from pallas_moe.quant.reference import correctly_rounded_reciprocal, smoothquant_rows_reference
from tests.test_quant_fp8 import fp8_layer

gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
x, plan, w1, w2 = fp8_layer(jax.random.key(92), 2048, 1536, 256, 16, 4, token_rounding=False)
experts = pm.quant.quantize_experts(w1, w2, dtype=jnp.int8)
E, d, n = experts.shape
rows_e = ffn._row_experts(plan)
valid = plan.row_is_valid
ones_d = jnp.ones((E, d), jnp.float32)
ones_n = jnp.ones((E, n), jnp.float32)
rows = jnp.arange(plan.capacity, dtype=jnp.int32)


def on_both(name, f, *args):
    outs = []
    for dev in (gpu, cpu):
        outs.append(jax.device_get(jax.jit(f)(*jax.device_put(args, dev))))
    flat = [jax.tree.leaves(o) for o in outs]
    report = []
    for a, b in zip(*flat):
        a, b = np.asarray(a), np.asarray(b)
        differ = int(np.sum(a.view(np.uint8) != b.view(np.uint8))) if a.dtype.itemsize == 1 else \
            int(np.sum(a != b))
        rel = float(np.linalg.norm((a.astype(np.float64) - b.astype(np.float64)).ravel())
                    / max(np.linalg.norm(b.astype(np.float64).ravel()), 1e-30))
        report.append(f"{a.dtype}{list(a.shape)}: {differ} differ, rel {rel:.2e}")
    print(f"{name}: " + "; ".join(report), flush=True)
    return outs[1]  # the CPU result feeds the next stage


q1, s1 = on_both("smoothquant X", lambda x, p: smoothquant_rows_reference(
    x, ones_d, p.token_ids, rows_e, valid, jnp.int8), x, plan)
a = on_both("up GEMM + dequant + SwiGLU", lambda q, s, g, w, c: fp8_grouped_matmul_reference(
    q, g, w, s, c, gated=True), q1, s1, plan.group_sizes, experts.w_gate_up,
    experts.gate_up_scales)
acc = jax.lax.ragged_dot(jnp.asarray(q1), jnp.swapaxes(experts.w_gate_up, 1, 2),
                         plan.group_sizes, preferred_element_type=jnp.int32).astype(jnp.float32)
on_both("  dequant + SwiGLU alone", lambda acc, s, c: fp8_epilogue_reference(
    acc, s, c, gated=True), jax.device_get(acc), s1, experts.gate_up_scales[jnp.asarray(rows_e)])
on_both("  sigmoid alone", jax.nn.sigmoid, jax.device_get(acc)[:, :n] * 1e-4)
sc = jnp.abs(jax.random.normal(jax.random.key(1), (100000,))) * 1e-3 + 1e-6
on_both("  correctly_rounded_reciprocal", correctly_rounded_reciprocal, sc)
q2, s2 = on_both("smoothquant A", lambda a: smoothquant_rows_reference(
    a, ones_n, rows, rows_e, valid, jnp.int8), a)
y = on_both("down GEMM + dequant", lambda q, s, g, w, c: fp8_grouped_matmul_reference(
    q, g, w, s, c, gated=False), q2, s2, plan.group_sizes, experts.w_down, experts.down_scales)
on_both("aggregation", lambda y, p: aggregate_rows(y, p, "fp32").astype(jnp.bfloat16), y, plan)
