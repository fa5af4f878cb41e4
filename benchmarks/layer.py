"""Whole-layer benchmark: `pm.moe_ffn` forward and forward+backward, and activation memory.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/layer.py --out $OUT [--shapes 7b,30b]

For each shape (`docs/measured.md`, benchmark shapes; top-K over random logits) and backend (`mosaic`,
`xla`) it times, with CUPTI (GPU kernel time of one call):
  - the forward, at `6*P*n*d` FLOPs, and forward+backward (grads of x, both weights and the
    scores), at `18*P*n*d` FLOPs;
  - the upper bound: the same FLOPs as perfectly balanced dense batched matmuls through XLA
    (`einsum('emd,edf->emf')` forward, and its autodiff backward), same run;
and measures activation memory two ways:
  - residual bytes: what `jax.vjp` keeps between forward and backward, inputs and weights
    excluded, against the floor `2*T*d + 4*P*n` (+16 bytes/row of routing metadata);
  - XLA's compiled temp buffer size of one jitted forward+backward step.
Writes layer.json and a markdown table into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp

import pallas_moe as pm
from benchmarks.forward import SHAPES, gpu_time_ms

FWD_BWD_ITERS = 5


def make_inputs(shape, seed=0, skew=0.0):
    num_tokens, d, n, num_experts, k = shape
    keys = jax.random.split(jax.random.key(seed), 5)
    logits = jax.random.normal(keys[0], (num_tokens, num_experts), jnp.float32)
    logits = logits.at[:, : max(1, num_experts // 16)].add(skew)
    x = jax.random.normal(keys[1], (num_tokens, d), jnp.bfloat16)
    w1 = (jax.random.normal(keys[2], (num_experts, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[3], (num_experts, n, d)) * n**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(keys[4], (num_tokens, d), jnp.bfloat16)
    plan = jax.jit(pm.routing.topk_plan, static_argnums=1)(logits, k)
    return x, plan, w1, w2, cot


def layer_fns(backend):
    def fwd(x, plan, w1, w2):
        return pm.moe_ffn(x, plan, w1, w2, backend=backend)

    def fwd_bwd(x, plan, w1, w2, cot):
        def loss(x, w1, w2, scores):
            out = pm.moe_ffn(x, plan.with_scores(scores), w1, w2, backend=backend)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

        # value_and_grad, not grad: with grad alone the loss is dead, and XLA drops the
        # forward's down-proj and aggregation (only H is needed for the gradients).
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w1, w2, plan.scores)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def dense_bound_fns(shape):
    """Balanced dense batched-matmul MoE with the same FLOPs (P/E rows per expert)."""
    num_tokens, d, n, num_experts, k = shape
    rows = num_tokens * k // num_experts

    def fwd(xe, w1, w2):  # xe [E, rows, d]
        h = jnp.einsum("emd,edf->emf", xe, w1)  # [E, rows, 2n]
        a = (jax.nn.silu(h[..., :n].astype(jnp.float32)) * h[..., n:]).astype(xe.dtype)
        return jnp.einsum("emn,end->emd", a, w2)  # [E, rows, d]

    def fwd_bwd(xe, w1, w2, cot):  # value_and_grad keeps the forward's down-proj alive
        loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) * cot)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(xe, w1, w2)

    xe = jax.random.normal(jax.random.key(7), (num_experts, rows, d), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(8), (num_experts, rows, d), jnp.float32)
    return jax.jit(fwd), jax.jit(fwd_bwd), xe, cot


def gemm_bound_fn(shape):
    """The layer's six GEMMs alone as balanced batched matmuls: `(f, operands)`.

    `f` runs the forward's `H = X W1`, `Y = A W2` and the backward's `dA = dY W2^T`,
    `dW2 = A^T dY`, `dX = dH W1^T`, `dW1 = X^T dH` on bf16 operands with P/E rows per
    expert: `18 P n d` FLOPs and nothing else (no SwiGLU, no f32 cotangent, no layout
    copies), the batched-matmul bound as SonicMoE states it. `dense_bound_fns`' fwd_bwd is
    a dense XLA layer with the same FLOPs, elementwise work included, so it takes longer.
    """
    num_tokens, d, n, num_experts, k = shape
    rows = num_tokens * k // num_experts
    ks = jax.random.split(jax.random.key(9), 4)
    xe = jax.random.normal(ks[0], (num_experts, rows, d), jnp.bfloat16)
    a = jax.random.normal(ks[1], (num_experts, rows, n), jnp.bfloat16)
    dy = jax.random.normal(ks[2], (num_experts, rows, d), jnp.bfloat16)
    dh = jax.random.normal(ks[3], (num_experts, rows, 2 * n), jnp.bfloat16)

    def gemms(xe, a, dy, dh, w1, w2):
        return (
            jnp.einsum("emd,edf->emf", xe, w1),  # H [E, rows, 2n]
            jnp.einsum("emn,end->emd", a, w2),  # Y [E, rows, d]
            jnp.einsum("emd,end->emn", dy, w2),  # dA [E, rows, n]
            jnp.einsum("emn,emd->end", a, dy),  # dW2 [E, n, d]
            jnp.einsum("emf,edf->emd", dh, w1),  # dX [E, rows, d]
            jnp.einsum("emd,emf->edf", xe, dh),  # dW1 [E, d, 2n]
        )

    return jax.jit(gemms), (xe, a, dy, dh)


def relative_error(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def residual_bytes(backend, x, plan, w1, w2):
    inputs = [x, w1, w2, *jax.tree.leaves(plan)]
    f = lambda x, w1, w2, s: pm.moe_ffn(x, plan.with_scores(s), w1, w2, backend=backend)
    _, vjp_fn = jax.vjp(f, x, w1, w2, plan.scores)
    leaves = [l for l in jax.tree.leaves(vjp_fn) if hasattr(l, "nbytes")]
    nbytes = sum(l.nbytes for l in leaves if not any(l is i for i in inputs))
    del vjp_fn
    return nbytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="7b,30b")
    parser.add_argument("--backends", default="xla,mosaic")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    device = jax.devices()[0].device_kind
    rows_out = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        num_tokens, d, n, num_experts, k = shape
        p = num_tokens * k
        flops_fwd, flops_all = 6 * p * n * d, 18 * p * n * d
        x, plan, w1, w2, cot = make_inputs(shape)
        bound_fwd, bound_all, xe, dcot = dense_bound_fns(shape)
        t_bound_fwd = gpu_time_ms(bound_fwd, xe, w1, w2)
        # profiler.measure keeps every iteration's outputs alive, and fwd+bwd outputs are
        # weight-sized gradients: few iterations, or 30B shapes run out of memory.
        t_bound_all = gpu_time_ms(bound_all, xe, w1, w2, dcot, iters=FWD_BWD_ITERS)
        floor = 2 * num_tokens * d + 4 * p * n
        reference = None  # gradients of the first backend that ran; later ones are checked against it
        for backend in args.backends.split(","):
            fwd, fwd_bwd = layer_fns(backend)
            row = dict(shape=name, T=num_tokens, d=d, n=n, E=num_experts, K=k, backend=backend)
            try:
                row["fwd_ms"] = gpu_time_ms(fwd, x, plan, w1, w2)
                row["fwd_bwd_ms"] = gpu_time_ms(fwd_bwd, x, plan, w1, w2, cot, iters=FWD_BWD_ITERS)
                grads = (fwd(x, plan, w1, w2), *fwd_bwd(x, plan, w1, w2, cot)[1])
                if reference is None:
                    reference = (backend, grads)
                else:
                    names = ("out", "dx", "dw_gate_up", "dw_down", "d_scores")
                    row["rel_err_vs_" + reference[0]] = {
                        name: relative_error(g, r) for name, g, r in zip(names, grads, reference[1])
                    }
                row["residual_bytes"] = residual_bytes(backend, x, plan, w1, w2)
                compiled = fwd_bwd.lower(x, plan, w1, w2, cot).compile()
                row["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
            except Exception as e:  # report and go on: one failing backend must not hide the rest
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row.update(
                bound_fwd_ms=t_bound_fwd, bound_fwd_bwd_ms=t_bound_all, residual_floor_bytes=floor,
                flops_fwd=flops_fwd, flops_fwd_bwd=flops_all,
            )
            rows_out.append(row)
            print(json.dumps(row), flush=True)

    lines = [
        f"Layer benchmark, {datetime.date.today()}, {device}. Ratios are bound time / our time.",
        "",
        "| shape | backend | fwd ms | fwd TFLOP/s | fwd vs bound | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd vs bound | residual GiB (floor) | XLA temp GiB | max rel err vs first backend |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gib = 2**30
    for r in rows_out:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['backend']} | error: {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['flops_fwd'] / r['fwd_ms'] / 1e9:.0f} | "
            f"{r['bound_fwd_ms'] / r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.3f} | "
            f"{r['flops_fwd_bwd'] / r['fwd_bwd_ms'] / 1e9:.0f} | {r['bound_fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f} | "
            f"{r['residual_bytes'] / gib:.3f} ({r['residual_floor_bytes'] / gib:.3f}) | {r['temp_bytes'] / gib:.2f} | "
            + (", ".join(f"{k} {v:.1e}" for k, v in errs.items()) if (errs := next(
                (v for k, v in r.items() if k.startswith("rel_err_vs_")), None)) else "reference")
            + " |"
        )
    table = "\n".join(lines)
    with open(os.path.join(args.out, "layer.json"), "w") as f:
        json.dump(rows_out, f, indent=1)
    with open(os.path.join(args.out, "layer.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
