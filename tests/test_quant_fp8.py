"""The fp8 inference path: the grouped GEMM's fp8 mode (e4m3 x e4m3 -> f32, dequantizing
epilogue, gated SwiGLU) in Mosaic GPU interpret mode against jnp/numpy references, its cuda
lowering at the 7B and 30B shapes, and `pm.quant.moe_ffn_fp8` (interpret and xla) against
the bf16 layer. Interpret mode fills fresh outputs with NaN: an unwritten real row fails and
rows a kernel must not touch are checked to still be NaN."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
from pallas_moe.kernels.reference import fp8_grouped_matmul_reference
from pallas_moe.routing import token_rounding_plan
from tests.test_kernels_common import assert_untouched, assignment_plan, races_found

E4M3 = jnp.float8_e4m3fn
# 3 CTAs walk the work items; block_k = 128 one-byte elements (one 128-byte swizzle row).
PING_PONG = GroupedMatmulConfig(block_m=64, block_n=64, block_k=128, num_stages=3, num_sms=3)
SPLIT_M = GroupedMatmulConfig(block_m=128, block_n=64, block_k=128, num_stages=2, num_sms=3)


def fp8_operands(key, capacity, k_dim, w_rows, num_experts):
    """e4m3 A [P, K] and W^T [E, w_rows, K] spread over e4m3's range, f32 scales."""
    ka, kw, kr, kc = jax.random.split(key, 4)
    a = (jax.random.normal(ka, (capacity, k_dim)) * 60).astype(E4M3)
    w = (jax.random.normal(kw, (num_experts, w_rows, k_dim)) * 60).astype(E4M3)
    row_scales = jax.random.uniform(kr, (capacity,), jnp.float32, 1e-3, 1e-2)
    col_scales = jax.random.uniform(kc, (num_experts, w_rows), jnp.float32, 1e-3, 1e-2)
    return a, w, row_scales, col_scales


def numpy_fp8_matmul(a, group_sizes, w, row_scales, col_scales):
    """float64: A[r] @ W[e]^T * row scale * column scale, per expert's rows."""
    a64 = np.asarray(a.astype(jnp.float32), np.float64)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    rs, cs = np.asarray(row_scales, np.float64), np.asarray(col_scales, np.float64)
    starts = np.concatenate([[0], np.cumsum(np.asarray(group_sizes))])
    out = np.zeros((a.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        rows = slice(starts[e], starts[e + 1])
        out[rows] = (a64[rows] @ w64[e].T) * rs[rows, None] * cs[e][None, :]
    return out


def run_fp8(plan, k_dim, n_out, num_experts, config, key, *, gated, interpret=True):
    w_rows = 2 * n_out if gated else n_out
    a, w, rs, cs = fp8_operands(key, plan.capacity, k_dim, w_rows, num_experts)
    got = grouped_matmul(a, plan.group_sizes, w, transpose_w=True, config=config,
                         interpret=interpret, row_scales=rs, col_scales=cs, gated=gated)
    rows = int(plan.num_rows)
    assert got.shape == (plan.capacity, n_out) and got.dtype == jnp.bfloat16
    g = np.asarray(got[:rows], np.float32)
    assert np.all(np.isfinite(g)), "unwritten (NaN) rows in the kernel output"
    want = np.asarray(fp8_grouped_matmul_reference(a, plan.group_sizes, w, rs, cs, gated=gated),
                      np.float32)[:rows]
    # Same products, f32 sums in another order, then one bf16 rounding (of each half, and of
    # A, when gated): within two bf16 steps of the reference.
    np.testing.assert_allclose(g, want, rtol=2**-7, atol=1e-6 * np.abs(want).max())
    if not gated:  # and the dequantized product itself, in float64
        exact = numpy_fp8_matmul(a, plan.group_sizes, w, rs, cs)[:rows]
        np.testing.assert_allclose(g, exact, rtol=2**-8, atol=1e-6 * np.abs(exact).max())
    assert_untouched(got, rows)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("config", [PING_PONG, SPLIT_M], ids=["ping_pong", "split_m"])
def test_fp8_ragged_groups_empty_experts_and_padding(config, gated):
    # Token rounding: groups start and end inside aligned blocks, padding rows at the end;
    # an empty expert (column 3's logits pushed down).
    logits = jax.random.normal(jax.random.key(40), (75, 5)).at[:, 3].add(-100.0)
    plan = token_rounding_plan(logits, 2, tile=8)
    assert int(plan.group_sizes[3]) == 0
    run_fp8(plan, 256, 128, 5, config, jax.random.key(41), gated=gated)


def test_fp8_no_races():
    plan = assignment_plan(jax.random.key(42), 40, 3, p=0.5, empty=(1,))
    run_fp8(plan, 256, 64, 3, SPLIT_M, jax.random.key(43), gated=True,
            interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()


def test_fp8_reference_matches_numpy():
    plan = assignment_plan(jax.random.key(44), 30, 4, p=0.4, empty=(2,), extra=5)
    a, w, rs, cs = fp8_operands(jax.random.key(45), plan.capacity, 128, 64, 4)
    got = fp8_grouped_matmul_reference(a, plan.group_sizes, w, rs, cs, gated=False,
                                       out_dtype=jnp.float32)
    want = numpy_fp8_matmul(a, plan.group_sizes, w, rs, cs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(transpose_w=False), "the fp8 mode needs transpose_w=True"),
        (dict(row_scales=None), "the fp8 mode .e4m3 inputs. needs row_scales and col_scales"),
        (dict(config=GroupedMatmulConfig(block_k=64)), "config.block_k=64 must be 128 for float8_e4m3fn"),
        (dict(col_scales=jnp.ones((2, 32), jnp.float32)), r"col_scales must have shape \(2, 128\)"),
        (dict(row_scales=jnp.ones((8,), jnp.float32)), r"row_scales must be \[P_a\] with P_a >= capacity=16"),
        (dict(w=jnp.zeros((2, 128, 128), jnp.bfloat16)), "w must have dtype float8_e4m3fn"),
        (dict(out_dtype=jnp.int8), "out_dtype must be bfloat16 or float32"),
    ],
)
def test_fp8_bad_inputs_raise(kwargs, match):
    args = dict(a=jnp.zeros((16, 128), E4M3), group_sizes=jnp.array([10, 6], jnp.int32),
                w=jnp.zeros((2, 128, 128), E4M3), transpose_w=True,
                config=GroupedMatmulConfig(block_m=64, block_k=128, num_sms=2), interpret=True,
                row_scales=jnp.ones((16,), jnp.float32), col_scales=jnp.ones((2, 128), jnp.float32))
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        grouped_matmul(**args)
    with pytest.raises(ValueError, match="row_scales, col_scales and gated belong to the fp8 mode"):
        grouped_matmul(jnp.zeros((16, 64), jnp.bfloat16), args["group_sizes"],
                       jnp.zeros((2, 64, 64), jnp.bfloat16), transpose_w=False, gated=True)
