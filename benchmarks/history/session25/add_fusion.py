"""Session 25: does XLA fold the router's dx into its GEMM (cuBLAS beta = 1)?

The 7B step spends ~56 us in a `wrapped_add` (x's two cotangents: the router's bf16 linear
`g @ w^T` and the MoE op's aggregated dX) beside a cuBLAS GEMM whose kernel name says beta =
0 (`_bz_`). Each formulation below computes `dx = g @ w^T + a` ([T, E] x [E, d] bf16, a
[T, d] bf16 from another op); the script prints, per formulation, the GEMM custom calls'
beta, the compiled fusions and the GPU time, so the step's add can be rewritten in the form
XLA fuses.

    PYTHONPATH=. python3 benchmarks/history/session25/add_fusion.py
"""
import json
import re

import jax
import jax.numpy as jnp

from benchmarks.forward import gpu_time_ms
from pallas_moe.kernels.aggregate import aggregate  # noqa: F401 (a Pallas producer below)

T, D, E = 24576, 1536, 128


def gemm_info(compiled_text):
    betas = re.findall(r'"beta":\s*([0-9.]+)', compiled_text)
    calls = re.findall(r'custom_call_target="(__cublas[^"]*)"', compiled_text)
    fusions = re.findall(r"kind=k(\w+)", compiled_text)
    return dict(gemms=calls, betas=betas, fusions=fusions)


def main():
    k = jax.random.split(jax.random.key(0), 4)
    g = jax.random.normal(k[0], (T, E), jnp.bfloat16)
    w = jax.random.normal(k[1], (D, E), jnp.bfloat16)
    z = jax.random.normal(k[2], (T, D), jnp.bfloat16)

    def producer(z):  # a [T, d] bf16 value made inside the jit (not a parameter)
        return (z.astype(jnp.float32) * 2).astype(jnp.bfloat16)

    variants = {
        # what _bf16_linear_bwd + add_any build today
        "bf16 dot, + a": lambda g, w, z: jnp.dot(g, w.T, preferred_element_type=jnp.bfloat16) + producer(z),
        "a + bf16 dot": lambda g, w, z: producer(z) + jnp.dot(g, w.T, preferred_element_type=jnp.bfloat16),
        "f32 dot + a, rounded": lambda g, w, z: (jnp.dot(g, w.T, preferred_element_type=jnp.float32)
                                                 + producer(z).astype(jnp.float32)).astype(jnp.bfloat16),
        "dot_general bf16 out": lambda g, w, z: jax.lax.dot_general(
            g, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16) + producer(z),
        "a param, + bf16 dot": lambda g, w, z: jnp.dot(g, w.T, preferred_element_type=jnp.bfloat16) + z,
    }
    # Added after call 3 (for the next session): the addend behind an optimization barrier,
    # which no fusion crosses, as the step's Pallas output; and dot forms that might keep
    # the dot out of XLA's Triton GEMM fusion (whose cuBLAS fallback never sees the add).
    barrier = lambda z: jax.lax.optimization_barrier(producer(z))  # noqa: E731
    variants.update({
        "barrier a + bf16 dot": lambda g, w, z: jnp.dot(
            g, w.T, preferred_element_type=jnp.bfloat16) + barrier(z),
        "barrier a + HIGHEST bf16 dot": lambda g, w, z: jnp.dot(
            g, w.T, preferred_element_type=jnp.bfloat16,
            precision=jax.lax.Precision.HIGHEST) + barrier(z),
        "barrier a + BF16_BF16_F32 dot": lambda g, w, z: jax.lax.dot(
            g, w.T, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
            preferred_element_type=jnp.bfloat16) + barrier(z),
    })
    rows = []
    for name, f in variants.items():
        jf = jax.jit(f)
        text = jf.lower(g, w, z).compile().as_text()
        info = gemm_info(text)
        us = 1e3 * gpu_time_ms(jf, g, w, z)
        rows.append((name, us, info))
        print(json.dumps(dict(variant=name, us=round(us, 1), **info)), flush=True)
    print("| formulation | us | cuBLAS betas | fusions |")
    print("|---|---|---|---|")
    for name, us, info in rows:
        print(f"| {name} | {us:.1f} | {','.join(info['betas']) or '-'} | {','.join(info['fusions']) or '-'} |")


if __name__ == "__main__":
    main()
