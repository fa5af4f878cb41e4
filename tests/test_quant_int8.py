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
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
from pallas_moe.kernels.reference import fp8_grouped_matmul_reference
from pallas_moe.routing import token_rounding_plan, topk_plan
from tests.test_kernels_common import assert_untouched, assignment_plan, races_found
from tests.test_quant_fp8 import fp8_layer, rel_err

INT8 = jnp.int8
SPLIT_M = GroupedMatmulConfig(block_m=128, block_n=64, block_k=128, num_stages=3, num_sms=3)
PING_PONG_128 = dataclasses.replace(SPLIT_M, pingpong=True)


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


@pytest.mark.parametrize("config, gated", [
    pytest.param(PING_PONG_128, False, id="ping_pong_128-plain"),
    pytest.param(SPLIT_M, True, id="split_m-gated"),
    # The other two pairings run the same code paths (opt-in: `-m slow`).
    pytest.param(PING_PONG_128, True, id="ping_pong_128-gated", marks=pytest.mark.slow),
    pytest.param(SPLIT_M, False, id="split_m-plain", marks=pytest.mark.slow),
])
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
    # s32 sums are exact: fp8_promote_every changes nothing (and needs no register room: the
    # 128-row ping-pong, which refuses e4m3 promotion, takes it).
    plan = assignment_plan(jax.random.key(84), 24, 2, p=0.5)
    a, w, rs, cs = int8_operands(jax.random.key(85), plan.capacity, 256, 64, 2)
    outs = [
        np.asarray(grouped_matmul(
            a, plan.group_sizes, w, transpose_w=True, interpret=True, row_scales=rs,
            col_scales=cs, out_dtype=jnp.float32,
            config=dataclasses.replace(PING_PONG_128, fp8_promote_every=every)))
        for every in (0, 1)
    ]
    rows = int(plan.num_rows)
    np.testing.assert_array_equal(outs[0][:rows].view(np.uint32), outs[1][:rows].view(np.uint32))


@pytest.mark.parametrize("shape", [(24576, 1536, 256, 128, 8), (32768, 4096, 512, 128, 8)],
                         ids=["7b", "30b"])
def test_int8_lowers_for_cuda_at_production_blocks(shape):
    """The gated up-proj (gathering the tokens' int8 rows, cp.async) and the down-proj at the
    fp8 forward's default block sizes, with int8 operands."""
    from tests.cuda_target import h100_target
    from tests.test_quant_fp8 import lower_gathered_up

    num_tokens, d, n, num_experts, k = shape
    sds = jax.ShapeDtypeStruct
    cfg = pm.quant.Fp8ForwardConfig.for_shape(d, n, num_sms=132)
    lower_gathered_up(cfg.up, shape, INT8)
    plan = jax.eval_shape(lambda l: topk_plan(l, k), sds((num_tokens, num_experts), jnp.float32))
    down = functools.partial(grouped_matmul, transpose_w=True, config=cfg.down)
    with h100_target():
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


# ---- the W8A8 int8 forward: `pm.quant.moe_ffn_fp8` on int8 experts

# int8 per-row absmax quantization keeps about 7 bits per element (e4m3: 4 significant
# bits), so four quantizations (X, W1, A, W2) stay well under the fp8 path's 0.1: 0.021
# measured on N(0,1) data in interpret mode (the fp8 path: 0.065).
INT8_VS_BF16_TOL = 0.05
# The kernels against the jnp steps: the same exact s32 sums and formulas; only the
# SwiGLU's sigmoid may round differently (ex2.approx on the GPU), moving a requantized
# element of A by one int8 step now and then. Measured: 1.4e-5 in interpret mode, 1.7e-5
# and 9.4e-6 on the H100 (session 19; 9.8e-3 before the reference rounded H with
# `round_bf16`, which XLA on GPU cannot drop).
INT8_KERNELS_VS_XLA_TOL = 1e-3


def test_quantize_experts_int8():
    _, _, w1, w2 = fp8_layer(jax.random.key(90), 8, 256, 128, 3, 2, token_rounding=False)
    experts = pm.quant.quantize_experts(w1, w2, dtype=INT8)
    assert experts.dtype == jnp.dtype(INT8)
    assert experts.w_gate_up.shape == (3, 256, 256) and experts.w_down.shape == (3, 256, 128)
    assert experts.w_gate_up.dtype == experts.w_down.dtype == jnp.int8
    # Per output channel: W1[e, :, j] ~= Q[e, j, :] * c[e, j], |Q| <= 127.
    back = experts.w_gate_up.astype(jnp.float32) * experts.gate_up_scales[..., None]
    np.testing.assert_allclose(np.asarray(back), np.asarray(jnp.swapaxes(w1, 1, 2), np.float32),
                               atol=float(experts.gate_up_scales.max()) / 2 * 1.0001)
    assert int(jnp.abs(experts.w_gate_up.astype(jnp.int32)).max()) <= 127
    with pytest.raises(ValueError, match="dtype must be float8_e4m3fn or int8, got int16"):
        pm.quant.quantize_experts(w1, w2, dtype=jnp.int16)


@pytest.mark.parametrize("smoothing", [
    pytest.param(False, id="per_token"),
    # CI time: its steps are covered apart (the int8 SmoothQuant kernel in test_quant.py, the
    # int8 GEMM on grouped rows above); the whole smoothed forward runs with `-m slow` and
    # on the GPU (test_int8_forward_on_gpu).
    pytest.param(True, id="smoothquant", marks=pytest.mark.slow),
])
def test_int8_forward_interpret_matches_xla_and_bf16(smoothing):
    # Token rounding: padding rows and an empty expert.
    x, plan, w1, w2 = fp8_layer(jax.random.key(91), 40, 256, 128, 4, 2, token_rounding=True)
    assert int(plan.group_sizes[1]) == 0 and int(plan.num_rows) < plan.capacity
    smooth_up, w1_quantized = None, w1
    if smoothing:  # the smoothing folded into the weights that are quantized
        act = pm.quant.expert_activation_absmax(x, plan)
        smooth_up, w1_quantized = pm.quant.calibrate_smoothing(act, w1, alpha=0.5)
    experts = pm.quant.quantize_experts(w1_quantized, w2, smooth_up=smooth_up, dtype=INT8)
    want = pm.moe_ffn(x, plan, w1, w2, backend="xla")
    ref = pm.quant.moe_ffn_fp8(x, plan, experts, backend="xla")
    got = pm.quant.moe_ffn_fp8(x, plan, experts, backend="interpret")
    assert got.shape == x.shape and got.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    assert rel_err(got, ref) < INT8_KERNELS_VS_XLA_TOL
    assert rel_err(ref, want) < INT8_VS_BF16_TOL
    assert rel_err(got, want) < INT8_VS_BF16_TOL
    print(f"int8 vs xla int8 {rel_err(got, ref):.2e}, vs bf16 {rel_err(got, want):.4f}")


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("smoothing", [False, True], ids=["per_token", "smoothquant"])
def test_int8_forward_on_gpu(smoothing):
    # The 7B widths, top-K; the output written after a poisoned buffer was freed.
    x, plan, w1, w2 = fp8_layer(jax.random.key(92), 2048, 1536, 256, 16, 4, token_rounding=False)
    want = jax.jit(functools.partial(pm.moe_ffn, backend="xla"))(x, plan, w1, w2)
    smooth_up = None
    if smoothing:
        act = pm.quant.expert_activation_absmax(x, plan)
        smooth_up, w1 = pm.quant.calibrate_smoothing(act, w1, alpha=0.5)
    experts = pm.quant.quantize_experts(w1, w2, smooth_up=smooth_up, dtype=INT8)
    junk = jnp.full((x.size * 64,), 0xFF, jnp.uint8).block_until_ready()
    del junk
    got = jax.jit(functools.partial(pm.quant.moe_ffn_fp8, backend="mosaic"))(x, plan, experts)
    ref = jax.jit(functools.partial(pm.quant.moe_ffn_fp8, backend="xla"))(x, plan, experts)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    print(f"int8 vs xla int8 {rel_err(got, ref):.2e}, vs bf16 {rel_err(got, want):.4f}")
    assert rel_err(got, ref) < INT8_KERNELS_VS_XLA_TOL
    assert rel_err(got, want) < INT8_VS_BF16_TOL
    again = jax.jit(functools.partial(pm.quant.moe_ffn_fp8, backend="mosaic"))(x, plan, experts)
    np.testing.assert_array_equal(np.asarray(again).view(np.uint16), np.asarray(got).view(np.uint16))
