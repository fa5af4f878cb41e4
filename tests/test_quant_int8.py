"""The grouped GEMM's int8 mode (W8A8: s8 x s8 -> s32 wgmma, dequantized in the epilogue).

int8 products sum exactly in s32, so the kernel's output is the reference's bit for bit
(`fp8_grouped_matmul_reference`: exact s32 sums, one rounding to f32, then the same f32
dequantization in the same order). Interpret mode on CPU (ragged groups, an empty expert,
padding rows, the gathered mode, the race detector), CUDA lowering at the production block
sizes, and a `gpu`-marked check on the H100 with poisoned outputs.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_moe as pm
from pallas_moe.kernels.grouped_gemm import INT8_MAX_K, GroupedMatmulConfig, grouped_matmul
from pallas_moe.kernels.reference import fp8_grouped_matmul_reference
from pallas_moe.routing import token_rounding_plan, topk_plan
from tests.test_kernels_common import assert_untouched, assignment_plan, races_found

INT8 = jnp.int8
PING_PONG = GroupedMatmulConfig(block_m=64, block_n=64, block_k=128, num_stages=3, num_sms=3)
SPLIT_M = GroupedMatmulConfig(block_m=128, block_n=64, block_k=128, num_stages=3, num_sms=3)


def int8_operands(key, rows, k_dim, w_rows, num_experts):
    """int8 A [rows, K] and W^T [E, w_rows, K] over the whole int8 range (-128 included),
    f32 row and column scales."""
    ka, kw, kr, kc = jax.random.split(key, 4)
    a = jax.random.randint(ka, (rows, k_dim), -128, 128).astype(INT8)
    w = jax.random.randint(kw, (num_experts, w_rows, k_dim), -128, 128).astype(INT8)
    row_scales = jax.random.uniform(kr, (rows,), jnp.float32, 1e-4, 1e-3)
    col_scales = jax.random.uniform(kc, (num_experts, w_rows), jnp.float32, 1e-4, 1e-3)
    return a, w, row_scales, col_scales


def ragged_plan():
    """Token rounding over 75 tokens, 5 experts (expert 3 empty): groups start and end
    inside aligned blocks, padding rows at the end."""
    logits = jax.random.normal(jax.random.key(80), (75, 5)).at[:, 3].add(-100.0)
    plan = token_rounding_plan(logits, 2, tile=8)
    assert int(plan.group_sizes[3]) == 0 and int(plan.num_rows) < plan.capacity
    return plan


def check_exact(got, a, plan, w, rs, cs, *, gated):
    rows = int(plan.num_rows)
    assert_untouched(got, rows)
    want = fp8_grouped_matmul_reference(a, plan.group_sizes, w, rs, cs, gated=gated,
                                        out_dtype=jnp.float32)
    g, wnt = np.asarray(got[:rows]), np.asarray(want[:rows])
    if gated:  # the SwiGLU's sigmoid: the kernel's formula, not jax.nn.sigmoid's bits
        np.testing.assert_allclose(g, wnt, rtol=1e-6, atol=1e-6 * np.abs(wnt).max())
    else:  # exact sums, the same f32 dequantization: the same bits
        np.testing.assert_array_equal(g.view(np.uint32), wnt.view(np.uint32))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("config", [PING_PONG, SPLIT_M], ids=["ping_pong", "split_m"])
def test_int8_grouped_matmul_equals_the_exact_reference(config, gated):
    plan = ragged_plan()
    n_out = 64
    # K = 384: three 128-element steps, each product up to 128^2.
    a, w, rs, cs = int8_operands(jax.random.key(81), plan.capacity, 384,
                                 2 * n_out if gated else n_out, 5)
    got = grouped_matmul(a, plan.group_sizes, w, transpose_w=True, config=config, interpret=True,
                         row_scales=rs, col_scales=cs, gated=gated, out_dtype=jnp.float32)
    assert got.shape == (plan.capacity, n_out) and got.dtype == jnp.float32
    check_exact(got, a, plan, w, rs, cs, gated=gated)


def test_int8_gathered_mode_no_races():
    # The gathered mode (rows of quantized tokens picked by token id) under the race
    # detector equals the exact reference on the materialized gather.
    plan = assignment_plan(jax.random.key(82), 40, 3, p=0.5, empty=(1,))
    n_out = 64
    q, w, rs, cs = int8_operands(jax.random.key(83), 40, 256, 2 * n_out, 3)
    got = grouped_matmul(q, plan.group_sizes, w, transpose_w=True, config=SPLIT_M,
                         interpret=plgpu.InterpretGPUParams(detect_races=True), row_scales=rs,
                         col_scales=cs, gated=True, token_ids=plan.token_ids,
                         out_dtype=jnp.float32)
    assert not races_found()
    ids = plan.token_ids
    check_exact(got, q[ids], plan, w, rs[ids], cs, gated=True)


def test_int8_mode_ignores_promotion():
    # s32 sums are exact: fp8_promote_every changes nothing (and needs no register room).
    plan = assignment_plan(jax.random.key(84), 24, 2, p=0.5)
    a, w, rs, cs = int8_operands(jax.random.key(85), plan.capacity, 256, 64, 2)
    outs = [
        np.asarray(grouped_matmul(
            a, plan.group_sizes, w, transpose_w=True, interpret=True, row_scales=rs,
            col_scales=cs, out_dtype=jnp.float32,
            config=dataclasses.replace(PING_PONG, fp8_promote_every=every)))
        for every in (0, 1)
    ]
    rows = int(plan.num_rows)
    np.testing.assert_array_equal(outs[0][:rows].view(np.uint32), outs[1][:rows].view(np.uint32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(w=jnp.zeros((2, 128, 128), jnp.float8_e4m3fn)), "w must have dtype int8"),
        (dict(a=jnp.zeros((16, 128), jnp.uint8)), "must have dtype bfloat16"),
        (dict(requant_smooth=jnp.ones((2, 128), jnp.float32), gated=True,
              w=jnp.zeros((2, 256, 128), INT8), col_scales=jnp.ones((2, 256), jnp.float32)),
         "requant_smooth quantizes the gated fp8 mode's A"),
        (dict(a=jnp.zeros((16, INT8_MAX_K + 128), INT8),
              w=jnp.zeros((2, 128, INT8_MAX_K + 128), INT8)),
         f"a.shape\\[1\\]={INT8_MAX_K + 128} must be <= {INT8_MAX_K} in the int8 mode"),
    ],
)
def test_int8_bad_inputs_raise(kwargs, match):
    args = dict(a=jnp.zeros((16, 128), INT8), group_sizes=jnp.array([10, 6], jnp.int32),
                w=jnp.zeros((2, 128, 128), INT8), transpose_w=True,
                config=GroupedMatmulConfig(block_m=64, block_k=128, num_sms=2), interpret=True,
                row_scales=jnp.ones((16,), jnp.float32), col_scales=jnp.ones((2, 128), jnp.float32))
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        grouped_matmul(**args)


@pytest.mark.parametrize("shape", [(24576, 1536, 256, 128, 8), (32768, 4096, 512, 128, 8)],
                         ids=["7b", "30b"])
def test_int8_lowers_for_cuda_at_production_blocks(shape):
    """The gated up-proj (gathering the tokens' int8 rows, cp.async) and the down-proj at the
    fp8 forward's default block sizes, with int8 operands."""
    from tests.cuda_target import h100_target

    num_tokens, d, n, num_experts, k = shape
    sds = jax.ShapeDtypeStruct
    cfg = pm.quant.Fp8ForwardConfig.for_shape(d, n, num_sms=132)
    plan = jax.eval_shape(lambda l: topk_plan(l, k), sds((num_tokens, num_experts), jnp.float32))
    up = functools.partial(grouped_matmul, transpose_w=True, config=cfg.up, gated=True)
    down = functools.partial(grouped_matmul, transpose_w=True, config=cfg.down)
    with h100_target():
        jax.jit(up).trace(
            sds((num_tokens, d), INT8), plan.group_sizes, sds((num_experts, 2 * n, d), INT8),
            row_scales=sds((num_tokens,), jnp.float32),
            col_scales=sds((num_experts, 2 * n), jnp.float32), token_ids=plan.token_ids,
        ).lower(lowering_platforms=("cuda",))
        jax.jit(down).trace(
            sds((plan.capacity, n), INT8), plan.group_sizes, sds((num_experts, d, n), INT8),
            row_scales=sds((plan.capacity,), jnp.float32),
            col_scales=sds((num_experts, d), jnp.float32),
        ).lower(lowering_platforms=("cuda",))


_on_hopper = (jax.devices()[0].platform == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "") == "9.0")


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("gated", [False, True], ids=["down", "gated_up"])
def test_int8_grouped_matmul_on_gpu(gated):
    # The 7B shape's blocks and widths, ragged token-rounding groups, outputs poisoned first:
    # the exact reference's bits (plain), within f32 rounding of its SwiGLU (gated).
    d, n = 1536, 256
    logits = jax.random.normal(jax.random.key(86), (4096, 64))
    plan = token_rounding_plan(logits, 8, tile=128)
    k_dim, w_rows = (d, 2 * n) if gated else (n, d)
    a, w, rs, cs = int8_operands(jax.random.key(87), plan.capacity, k_dim, w_rows, 64)
    cfg = pm.quant.Fp8ForwardConfig.for_shape(d, n)
    config = cfg.up if gated else cfg.down
    # f32 output for the gated up-proj (its SwiGLU compared within f32 rounding); the
    # down-proj in bf16, its config's output (an f32 tile would not fit its SMEM), bit for bit.
    out_dtype = jnp.float32 if gated else jnp.bfloat16
    junk = jnp.full((plan.capacity * w_rows * 4,), 0xFF, jnp.uint8).block_until_ready()
    del junk
    f = jax.jit(functools.partial(grouped_matmul, transpose_w=True, config=config, gated=gated,
                                  out_dtype=out_dtype))
    got = f(a, plan.group_sizes, w, row_scales=rs, col_scales=cs)
    rows = int(plan.num_rows)
    want = fp8_grouped_matmul_reference(a, plan.group_sizes, w, rs, cs, gated=gated,
                                        out_dtype=out_dtype)
    g, wnt = np.asarray(got[:rows]), np.asarray(want[:rows])
    assert np.all(np.isfinite(g.astype(np.float32)))
    if gated:  # ex2.approx in the SwiGLU (approx_math, the default)
        np.testing.assert_allclose(g, wnt, rtol=2e-6, atol=1e-6 * np.abs(wnt).max())
    else:
        np.testing.assert_array_equal(g.view(np.uint16), wnt.view(np.uint16))
