"""MoE SmoothQuant (kernel in Mosaic GPU interpret mode, and the jnp reference) vs numpy.

The numpy reference below is written from the formula, independently of the library, in
f32: `Y = x[t] * S[e]`, `s = max|Y| * fl(1/qmax)`, `Q = saturate(round_half_even(Y * fl(1/s)))`;
scales below the smallest normal f32 -> zero row (s = 0, Q = 0); padding rows -> Q = 0, s = 0. Both backends must match it bit for
bit. Interpret mode poisons fresh outputs (int8 with 127 everywhere, e4m3 with NaN), so a row
the kernel forgot to write fails the comparison.
"""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_moe as pm
from pallas_moe.quant import RowBlockQuantConfig, SmoothQuantConfig
from pallas_moe.routing import topk_plan
from tests.test_kernels_common import assignment_plan, races_found

INT8, E4M3 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)
QMAX = {INT8: 127.0, E4M3: 448.0}
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


def numpy_smoothquant(x, smooth, tokens, experts, valid, out_dtype):
    """The formula in numpy float32 (ml_dtypes for e4m3): Q [R, d], s [R]."""
    qmax = np.float32(QMAX[jnp.dtype(out_dtype)])
    tokens, experts, valid = np.asarray(tokens), np.asarray(experts), np.asarray(valid, bool)
    y = np.asarray(x, np.float32)[tokens] * np.asarray(smooth, np.float32)[np.minimum(experts, len(smooth) - 1)]
    s = np.max(np.abs(y), axis=1) * (np.float32(1) / qmax)  # f32 throughout
    s[s < np.finfo(np.float32).tiny] = 0  # scales below the smallest normal f32: zero rows
    with np.errstate(divide="ignore"):
        inv = np.where(s > 0, np.float32(1) / s, np.float32(0)).astype(np.float32)
    v = np.clip(y * inv[:, None], -qmax, qmax)
    if jnp.dtype(out_dtype) == INT8:
        q = np.rint(v).astype(np.int8)  # np.rint: round half to even
    else:
        q = v.astype(ml_dtypes.float8_e4m3fn)
    q[~valid] = 0
    s[~valid] = 0
    return q, s


def assert_bitwise(got_q, got_s, want_q, want_s):
    got_q = np.asarray(got_q)
    assert got_q.dtype == want_q.dtype
    gq, wq = got_q.view(np.uint8), want_q.view(np.uint8)
    bad = np.argwhere(gq != wq)
    assert bad.size == 0, (
        f"{len(bad)} Q elements differ, first at {bad[0].tolist()}: "
        f"got {got_q[tuple(bad[0])]}, want {want_q[tuple(bad[0])]}"
    )
    np.testing.assert_array_equal(np.asarray(got_s), want_s)


def plan_rows(plan):
    return plan.token_ids, plan.expert_ids, plan.row_is_valid


def special_x(key, num_tokens, d, dtype=jnp.bfloat16, at=(1, 2, 3, 4, 5)):
    """Random rows (spread over 6 decades), a zero row, rows with the largest bf16 (bf16 only),
    a row so small its scale is below the smallest normal f32 (-> zero row) and a small but
    ordinary row, at tokens `at`. Every nonzero x * S stays a normal f32 (XLA:CPU flushes
    subnormals)."""
    k1, k2 = jax.random.split(key)
    mag = 10.0 ** jax.random.uniform(k1, (num_tokens, d), jnp.float32, -3, 3)
    x = (mag * jax.random.normal(k2, (num_tokens, d), jnp.float32)).astype(dtype)
    zero, huge, one_huge, tiny, small = at
    x = x.at[zero].set(0)
    if dtype == jnp.bfloat16:
        x = x.at[huge].set(jnp.where(jnp.arange(d) % 3 == 0, -BF16_MAX, BF16_MAX).astype(dtype))
        x = x.at[one_huge, 5].set(BF16_MAX)  # one huge value among ordinary ones
        sign = jnp.where(jnp.arange(d) % 2 == 0, 1.0, -1.0)
        x = x.at[tiny].set((1e-36 * sign).astype(dtype))  # scale < 2^-126: a zero row
        x = x.at[small].set((1e-33 * sign * (1 + jnp.arange(d) / d)).astype(dtype))
    return x


def smooth_scales(key, num_experts, d, high=1.0):
    # <= 1 keeps x * S finite for the largest bf16 inputs.
    return jax.random.uniform(key, (num_experts, d), jnp.float32, 0.05, high)


@functools.cache
def plan_quant(out_dtype, backend, config=SmoothQuantConfig()):
    return jax.jit(functools.partial(
        pm.quant.moe_smoothquant, out_dtype=out_dtype, backend=backend, config=config
    ))


@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_kernel_grouped_order_matches_numpy(out_dtype):
    # Ragged groups, an empty expert, tokens with 0..3 rows, 7 padding rows.
    num_tokens, d, num_experts = 21, 256, 5
    ks = jax.random.split(jax.random.key(0), 3)
    plan = assignment_plan(ks[0], num_tokens, num_experts, p=0.35, empty=(3,), extra=7)
    rows_per_token = np.asarray(plan.rows_per_token)
    assert rows_per_token.min() == 0 and rows_per_token.max() >= 3
    special = tuple(np.flatnonzero(rows_per_token)[:5])  # tokens with rows get the special rows
    x = special_x(ks[1], num_tokens, d, at=special)
    smooth = smooth_scales(ks[2], num_experts, d)
    want = numpy_smoothquant(x, smooth, *plan_rows(plan), out_dtype)
    for backend in ["interpret", "xla"]:
        q, s = plan_quant(out_dtype, backend)(x, smooth, plan)
        assert q.shape == (plan.capacity, d) and s.dtype == jnp.float32
        assert_bitwise(q, s, *want)
    rows = int(plan.num_rows)
    assert np.all(np.asarray(s[rows:]) == 0) and np.all(np.asarray(q[rows:], np.float32) == 0)
    scales_of = lambda t: np.asarray(s[:rows])[np.asarray(plan.token_ids[:rows]) == t]  # noqa: E731
    zero, huge, _, tiny, small = special
    assert np.all(scales_of(zero) == 0) and np.all(scales_of(tiny) == 0)
    assert np.all(scales_of(small) > 0)
    assert np.all(np.isfinite(scales_of(huge))) and np.all(scales_of(huge) > 1e35)


@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_kernel_topk_layout_matches_numpy(out_dtype):
    # fp16 input, smooth scales above 1, K=3 of 4 experts; block_t=2 with T odd.
    num_tokens, d, num_experts, k = 9, 384, 4, 3
    ks = jax.random.split(jax.random.key(1), 3)
    ids = jax.random.randint(ks[0], (num_tokens, k), 0, num_experts)
    x = special_x(ks[1], num_tokens, d, jnp.float16)
    smooth = smooth_scales(ks[2], num_experts, d, high=8.0)
    tokens = np.repeat(np.arange(num_tokens), k)
    want_q, want_s = numpy_smoothquant(x, smooth, tokens, np.asarray(ids).reshape(-1),
                                       np.ones(num_tokens * k, bool), out_dtype)
    cfg = SmoothQuantConfig(block_t=2, vec=1)
    for backend in ["interpret", "xla"]:
        q, s = pm.quant.moe_smoothquant_topk(x, smooth, ids, out_dtype=out_dtype,
                                             backend=backend, config=cfg)
        assert q.shape == (num_tokens, k, d) and s.shape == (num_tokens, k)
        assert_bitwise(q.reshape(-1, d), s.reshape(-1), want_q, want_s)


def test_rounding_is_half_to_even_and_saturating():
    """Hand-computed rows: s = 1 exactly, so Q is the rounding of the inputs themselves."""
    d = 128
    row_int8 = np.zeros(d, np.float32)
    row_int8[:9] = [127, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 126.5, -126.5]
    row_fp8 = np.zeros(d, np.float32)
    # e4m3 has 3 mantissa bits: 1.0625 ties 1.0/1.125 -> 1.0; 1.1875 ties 1.125/1.25 -> 1.25;
    # 0.0029296875 = 1.5 * 2^-9 ties the subnormals 2^-9 / 2^-8 -> 2^-8; 432 ties 416/448 ->
    # 448; 424 -> 416.
    row_fp8[:7] = [448, 1.0625, 1.1875, -1.1875, 0.0029296875, 432, 424]
    x = jnp.asarray(np.stack([row_int8, row_fp8]), jnp.bfloat16)
    assert np.array_equal(np.asarray(x, np.float32), np.stack([row_int8, row_fp8]))
    smooth = jnp.ones((1, d), jnp.float32)
    ids = jnp.zeros((2, 1), jnp.int32)
    cfg = SmoothQuantConfig(vec=1)
    for backend in ["interpret", "xla"]:
        q, s = pm.quant.moe_smoothquant_topk(x, smooth, ids, out_dtype=INT8, backend=backend,
                                             config=cfg)
        assert float(s[0, 0]) == 1.0
        np.testing.assert_array_equal(np.asarray(q[0, 0, :9]), [127, 0, 2, 2, 0, -2, 4, 126, -126])
        q, s = pm.quant.moe_smoothquant_topk(x, smooth, ids, out_dtype=E4M3, backend=backend,
                                             config=cfg)
        assert float(s[1, 0]) == 1.0
        np.testing.assert_array_equal(np.asarray(q[1, 0, :7], np.float32),
                                      [448, 1.0, 1.25, -1.25, 2.0**-8, 448, 416])


def test_reciprocal_is_correctly_rounded_from_any_estimate_within_4_ulp():
    """The shared `rcp(s)` equals numpy's correctly rounded `1 / s` whatever the platform's
    division returns within 4 ulp (the H100's `div.full.f32` is up to 2 ulp off: the first
    GPU run of the e4m3 test failed on it)."""
    from pallas_moe.quant.reference import correctly_rounded_reciprocal

    rng = np.random.default_rng(0)
    pow2 = np.float32(2.0) ** np.arange(-126, 121).astype(np.float32)
    s = np.concatenate([
        (10.0 ** rng.uniform(-37, 36, 20000)).astype(np.float32),  # every scale's range
        pow2, np.nextafter(pow2, np.float32(np.inf)), np.nextafter(pow2[1:], np.float32(0)),
    ]).astype(np.float32)
    want = (np.float32(1) / s).view(np.uint32)
    rcp = jax.jit(correctly_rounded_reciprocal)
    np.testing.assert_array_equal(np.asarray(rcp(s)).view(np.uint32), want)
    # Estimates of 1/m (m = s's mantissa in [1, 2)) off by -4..4 ulp inside [0.5, 1].
    m = ((s.view(np.int32) & 0x7FFFFF) | (127 << 23)).view(np.float32)
    exact_m = (np.float32(1) / m).view(np.int32)
    for off in [-4, -3, -2, -1, 1, 2, 3, 4]:
        approx = np.clip(exact_m + off, np.float32(0.5).view(np.int32), np.float32(1).view(np.int32))
        got = np.asarray(rcp(s, approx.view(np.float32))).view(np.uint32)
        np.testing.assert_array_equal(got, want, err_msg=f"estimate {off} ulp off")
    specials = np.asarray(rcp(jnp.array([np.nan, np.inf], jnp.float32)))
    assert np.isnan(specials[0]) and specials[1] == 0


def test_dequantized_rows_are_within_half_a_step():
    """Float64 check of the meaning of (Q, s): |Q*s - Y| <= s/2 (int8), e4m3's relative step."""
    num_tokens, d, num_experts = 64, 512, 8
    ks = jax.random.split(jax.random.key(2), 3)
    plan = topk_plan(jax.random.normal(ks[0], (num_tokens, num_experts)), 2)
    x = special_x(ks[1], num_tokens, d)
    smooth = smooth_scales(ks[2], num_experts, d, high=1.0)
    y = (np.asarray(x, np.float64)[np.asarray(plan.token_ids)]
         * np.asarray(smooth, np.float64)[np.asarray(plan.expert_ids)])
    for out_dtype in [INT8, E4M3]:
        q, s = plan_quant(out_dtype, "xla")(x, smooth, plan)
        s64 = np.asarray(s, np.float64)[:, None]
        q64 = np.asarray(q, np.float64)
        live = s64[:, 0] > 0
        np.testing.assert_allclose(np.max(np.abs(q64), axis=1)[live], QMAX[out_dtype])
        # Zero rows: exactly those whose scale max|Y| / qmax is below the smallest normal f32.
        tiny = np.max(np.abs(y), axis=1) / QMAX[out_dtype] < np.finfo(np.float32).tiny
        np.testing.assert_array_equal(~live, tiny)
        assert np.all(q64[~live] == 0)
        q64, s64, y_live = q64[live], s64[live], y[live]
        err = np.abs(q64 * s64 - y_live)
        # Slack for the f32 rounding of x * S and Y / s: a few qmax * 2^-24 in units of s.
        if out_dtype == INT8:
            bound = s64 * (0.5 + 2e-5)
        else:  # half an e4m3 ulp: 2^-4 relative for normals, 2^-10 * s for subnormals
            bound = np.maximum(np.abs(y_live) * 2.0**-4, s64 * 2.0**-10) + s64 * 6e-5
        assert np.all(err <= bound)


def test_no_races_and_padding_ctas():
    # Token rows and padding rows written by different CTAs; the race detector watches.
    num_tokens, d, num_experts = 10, 128, 3
    ks = jax.random.split(jax.random.key(3), 3)
    plan = assignment_plan(ks[0], num_tokens, num_experts, p=0.5, extra=11)
    x = special_x(ks[1], num_tokens, d)
    smooth = smooth_scales(ks[2], num_experts, d)
    params = plgpu.InterpretGPUParams(detect_races=True)
    q, s = pm.quant.moe_smoothquant(x, smooth, plan, out_dtype=INT8, backend="interpret",
                                    config=SmoothQuantConfig(block_t=3, block_pad=4),
                                    interpret_params=params)
    assert not races_found()
    assert_bitwise(q, s, *numpy_smoothquant(x, smooth, *plan_rows(plan), INT8))


def _config_matches_numpy(seed, config, *, x_dtype=jnp.bfloat16, out_dtype=INT8, edit_x=None):
    """`moe_smoothquant` in interpret mode with `config`, races watched, against the numpy
    formula bit for bit: 13 tokens with 0..3+ rows each over 4 experts, padding rows, the
    special rows of `special_x` on tokens that own rows. Returns the plan."""
    num_tokens, d, num_experts = 13, 256, 4
    ks = jax.random.split(jax.random.key(seed), 3)
    plan = assignment_plan(ks[0], num_tokens, num_experts, p=0.5, extra=5)
    rows_per_token = np.asarray(plan.rows_per_token)
    x = special_x(ks[1], num_tokens, d, dtype=x_dtype,
                  at=tuple(np.flatnonzero(rows_per_token)[:5]))
    x = x if edit_x is None else edit_x(x)
    smooth = smooth_scales(ks[2], num_experts, d)
    params = plgpu.InterpretGPUParams(detect_races=True)
    q, s = pm.quant.moe_smoothquant(
        x, smooth, plan, out_dtype=out_dtype, backend="interpret", interpret_params=params,
        config=config)
    assert not races_found()
    assert_bitwise(q, s, *numpy_smoothquant(x, smooth, *plan_rows(plan), out_dtype))
    return plan


@pytest.mark.parametrize("x_dtype,out_dtype", [(jnp.bfloat16, E4M3), (jnp.float16, INT8)],
                         ids=["bf16-e4m3", "fp16-int8"])
def test_x_per_row_same_bits(x_dtype, out_dtype):
    """`SmoothQuantConfig(x_per_row=True)`: the X row held in x's dtype and widened for each
    of the token's rows (through an OR with a zero made from the output row) gives the numpy
    formula's bits, negative zeros included: tokens with 0..3 rows, padding CTAs, several
    tokens per CTA, races watched."""
    _config_matches_numpy(
        11, SmoothQuantConfig(block_t=2, block_pad=8, x_per_row=True), x_dtype=x_dtype,
        out_dtype=out_dtype,  # -0 * S is -0: its bits must survive the widening's OR
        edit_x=lambda x: x.at[6, ::2].set(-0.0))


@pytest.mark.parametrize("slots,block_t,x_per_row", [
    (1, 2, False), (2, 1, True), (2, 2, False), pytest.param(3, 2, False, marks=pytest.mark.slow)])
def test_scale_rows_smem_same_bits(slots, block_t, x_per_row):
    """`SmoothQuantConfig.scale_rows_smem`: smooth-scale rows copied to 1-3 SMEM slots by
    TMA, each slot refilled once every thread has read it, give the numpy formula's bits:
    tokens with 0..3+ rows (fewer rows than slots, and more), padding CTAs, one and several
    tokens per CTA (the slots' barriers carry their phases from token to token), with the
    f32 X row held or X widened per row (2 slots with X per row: the default from d = 4096
    on), races watched (a refill before the slot's reads would be one)."""
    plan = _config_matches_numpy(
        13, SmoothQuantConfig(block_t=block_t, block_pad=8, scale_rows_smem=slots,
                              x_per_row=x_per_row))
    rows_per_token = np.asarray(plan.rows_per_token)
    assert rows_per_token.min() == 0 and rows_per_token.max() > slots


def test_scale_rows_smem_default_by_width():
    """Two staged rows from d = 4096 on (where they measured faster), none below; an
    explicit count is kept at every width."""
    from pallas_moe.quant.kernel import STAGED_MIN_D, STAGED_ROWS

    assert (STAGED_MIN_D, STAGED_ROWS) == (4096, 2)
    default = SmoothQuantConfig()
    assert [default.resolve_scale_rows_smem(d) for d in (1536, 2048, 4096, 7168)] == [0, 0, 2, 2]
    assert SmoothQuantConfig(scale_rows_smem=0).resolve_scale_rows_smem(7168) == 0
    assert SmoothQuantConfig(scale_rows_smem=3).resolve_scale_rows_smem(1536) == 3


def test_scale_rows_smem_is_validated():
    """Negative slots and slots over the SMEM a CTA may stage are refused with the argument
    named."""
    from pallas_moe.quant.kernel import smoothquant_kernel

    with pytest.raises(ValueError, match="scale_rows_smem=-1 must be >= 0"):
        SmoothQuantConfig(scale_rows_smem=-1)
    d = 7168
    x, smooth = jnp.zeros((4, d), jnp.bfloat16), jnp.ones((2, d), jnp.float32)
    offsets, rows = jnp.arange(5, dtype=jnp.int32), jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="scale_rows_smem=8 rows of d=7168 .* bytes of SMEM"):
        smoothquant_kernel(x, smooth, offsets, rows, rows % 2, None, num_out_rows=4,
                           out_dtype=INT8, config=SmoothQuantConfig(scale_rows_smem=8),
                           interpret=True)


def test_kernel_without_smooth_scales_equals_ones():
    """`smooth_scales=None` (the fp8 forward's unsmoothed X and A): Q and s computed once per
    token and stored at each of its rows, the bits of a smoothing by ones; tokens with 0..3
    rows, padding CTAs, prefetch across a CTA's tokens (block_t=3, T not a multiple), races
    watched."""
    from pallas_moe.quant.kernel import smoothquant_kernel

    num_tokens, d, num_experts = 20, 256, 4
    ks = jax.random.split(jax.random.key(5), 2)
    plan = assignment_plan(ks[0], num_tokens, num_experts, p=0.4, extra=9)
    assert np.asarray(plan.rows_per_token).min() == 0 and np.asarray(plan.rows_per_token).max() >= 2
    x = special_x(ks[1], num_tokens, d)
    row_experts = jnp.minimum(plan.expert_ids[plan.rows_by_token], num_experts - 1)
    meta = (plan.token_row_offsets, plan.rows_by_token, row_experts, plan.num_rows)
    cfg = SmoothQuantConfig(block_t=3, block_pad=8)
    params = plgpu.InterpretGPUParams(detect_races=True)
    q, s = smoothquant_kernel(x, None, *meta, num_out_rows=plan.capacity, out_dtype=E4M3,
                              config=cfg, interpret=params)
    assert not races_found()
    ones = jnp.ones((num_experts, d), jnp.float32)
    assert_bitwise(q, s, *numpy_smoothquant(x, ones, *plan_rows(plan), E4M3))


def test_out_of_range_topk_ids():
    x = jnp.ones((4, 128), jnp.bfloat16)
    smooth = jnp.ones((3, 128), jnp.float32)
    ids = jnp.array([[0, 1], [2, 3], [1, 0], [-1, 2]], jnp.int32)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, E=3\); got 2 ids outside"):
        pm.quant.moe_smoothquant_topk(x, smooth, ids, backend="xla")
    # Under jit the ids cannot be checked: their rows are marked by a NaN scale.
    _, s = jax.jit(lambda i: pm.quant.moe_smoothquant_topk(x, smooth, i, backend="xla"))(ids)
    np.testing.assert_array_equal(np.isnan(np.asarray(s)), np.asarray((ids < 0) | (ids >= 3)))


def test_bad_inputs_raise():
    plan = topk_plan(jnp.zeros((8, 4)), 2)
    x = jnp.zeros((8, 256), jnp.bfloat16)
    smooth = jnp.ones((4, 256), jnp.float32)
    q = pm.quant.moe_smoothquant
    with pytest.raises(ValueError, match="out_dtype must be int8 or float8_e4m3fn, got bfloat16"):
        q(x, smooth, plan, out_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="x must be bf16 or fp16, got float32"):
        q(x.astype(jnp.float32), smooth, plan)
    with pytest.raises(TypeError, match="smooth_scales must be f32"):
        q(x, smooth.astype(jnp.bfloat16), plan)
    with pytest.raises(ValueError, match=r"smooth_scales must be \[E, d\] with d=256"):
        q(x, smooth[:, :128], plan)
    with pytest.raises(ValueError, match="smooth_scales has 3 experts but the plan routes to E=4"):
        q(x, smooth[:3], plan)
    with pytest.raises(ValueError, match="plan was built for T=8 tokens but x has T=4"):
        q(x[:4], smooth, plan)
    with pytest.raises(TypeError, match="plan must be a pallas_moe.routing.DispatchPlan"):
        q(x, smooth, plan.token_ids)
    with pytest.raises(ValueError, match=r"topk_ids must be \[T, K\] with T=8"):
        pm.quant.moe_smoothquant_topk(x, smooth, jnp.zeros((4, 2), jnp.int32))
    with pytest.raises(TypeError, match="topk_ids must be an integer array"):
        pm.quant.moe_smoothquant_topk(x, smooth, jnp.zeros((8, 2)))
    narrow = jnp.zeros((8, 192), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"d \(x.shape\[1\]\)=192 must be a multiple of 128"):
        q(narrow, smooth[:, :192], plan, backend="interpret")
    with pytest.raises(ValueError, match=r"d \(x.shape\[1\]\)=256 must be a multiple of 1024"):
        q(x, smooth, plan, backend="interpret", config=SmoothQuantConfig(vec=8))
    # "auto" takes any width (the reference where the kernel does not apply).
    assert q(narrow, smooth[:, :192], plan, backend="auto")[0].shape == (16, 192)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_config_of_another_kernel_raises(backend):
    # One kernel per op: `config` takes only the CSR kernel's SmoothQuantConfig. A config of
    # another kernel (the row-block quantizer's, or one shaped like the removed gathered
    # row-block kernel's) must not silently run the CSR kernel's defaults, on any backend.
    @dataclasses.dataclass(frozen=True)
    class GatheredLikeConfig:
        parts: int = 2
        block_cols: int = 128

    plan = topk_plan(jnp.zeros((8, 4)), 2)
    x = jnp.zeros((8, 256), jnp.bfloat16)
    smooth = jnp.ones((4, 256), jnp.float32)
    expected = r"config must be None or a pallas_moe.quant.SmoothQuantConfig .*, got "
    for wrong in (GatheredLikeConfig(), RowBlockQuantConfig(), "fast"):
        with pytest.raises(TypeError, match=expected + type(wrong).__name__):
            pm.quant.moe_smoothquant(x, smooth, plan, backend=backend, config=wrong)


def _abstract_plan(num_tokens, num_experts, k):
    return jax.eval_shape(lambda l: topk_plan(l, k), jax.ShapeDtypeStruct((num_tokens, num_experts), jnp.float32))


@pytest.mark.parametrize("d", [2048, 4096, 7168])
@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_lowers_for_cuda_at_production_widths(d, out_dtype):
    # The 30B shape's T, E, K (T*K = 262144 rows); lowering cost does not depend on T.
    num_tokens, num_experts, k = 32768, 128, 8
    from tests.cuda_target import h100_target

    with h100_target():  # the AOT target `backend="mosaic"`'s device check reads
        _lower_smoothquant(num_tokens, num_experts, k, d, out_dtype)


@pytest.mark.parametrize("d,slots", [(1536, 4), (7168, 1)])
def test_scale_rows_smem_lowers_for_cuda(d, slots):
    """Smooth-scale rows staged in SMEM by TMA against the width defaults (2 slots from
    d = 4096 on, lowered in `test_lowers_for_cuda_at_production_widths`): 4 slots at the 7B
    width, 1 at DeepSeek-V3's."""
    from tests.cuda_target import h100_target

    with h100_target():
        _lower_smoothquant(8192, 256, 8, d, INT8, SmoothQuantConfig(scale_rows_smem=slots))


@pytest.mark.parametrize("d,x_per_row", [(1536, True), (7168, False)])
def test_x_per_row_lowers_for_cuda(d, x_per_row):
    """`x_per_row` against its width default (the default lowers in
    `test_lowers_for_cuda_at_production_widths`): X widened per row at the 7B width, and the
    f32 row held at DeepSeek-V3's."""
    from tests.cuda_target import h100_target

    assert SmoothQuantConfig().resolve_x_per_row(d) != x_per_row
    with h100_target():
        _lower_smoothquant(8192, 256, 8, d, E4M3, SmoothQuantConfig(x_per_row=x_per_row))


def _lower_smoothquant(num_tokens, num_experts, k, d, out_dtype, config=None):
    sds = jax.ShapeDtypeStruct
    x_dtype = jnp.float16 if d == 4096 else jnp.bfloat16  # fp16 input once
    x, smooth = sds((num_tokens, d), x_dtype), sds((num_experts, d), jnp.float32)
    f = functools.partial(pm.quant.moe_smoothquant, out_dtype=out_dtype, backend="mosaic",
                          config=config)
    jax.jit(f).trace(x, smooth, _abstract_plan(num_tokens, num_experts, k)).lower(
        lowering_platforms=("cuda",))
    g = functools.partial(pm.quant.moe_smoothquant_topk, out_dtype=out_dtype, backend="mosaic")
    jax.jit(g).trace(x, smooth, sds((num_tokens, k), jnp.int32)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("dtype", [E4M3, INT8], ids=["e4m3", "int8"])
def test_8bit_wgmma_runs_in_interpret_mode_and_lowers(dtype):
    """What a quantized grouped GEMM can build on in jax 0.11.2: e4m3 x e4m3 -> f32 and
    s8 x s8 -> s32 wgmma, with B K-major (8-bit wgmma has no transposed-B form, so weights
    `[E, in, out]` must be laid out `[E, out, in]` for it)."""
    from jax.experimental import pallas as pl

    m, n, k = 64, 64, 128
    acc_dtype = jnp.float32 if dtype == E4M3 else jnp.int32
    tf = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))  # 128 one-byte elements

    def body(a_ref, bt_ref, o_ref, a_smem, bt_smem, bar):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(bt_ref, bt_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])

        def scope(acc):
            plgpu.wgmma(acc, a_smem, bt_smem.T)  # [m, k] @ [k, n], B stored [n, k]
            plgpu.wgmma_wait(0)
            return acc[...]

        o_ref[...] = pl.run_scoped(scope, plgpu.ACC((m, n), acc_dtype))

    def matmul(interpret):
        return plgpu.kernel(
            body, out_type=jax.ShapeDtypeStruct((m, n), acc_dtype),
            scratch_types=[plgpu.SMEM((m, k), dtype, transforms=tf),
                           plgpu.SMEM((n, k), dtype, transforms=tf),
                           plgpu.Barrier(num_arrivals=2, num_barriers=1)],
            grid=(1,), grid_names=("i",),
            interpret=plgpu.InterpretGPUParams() if interpret else None,
        )

    rng = np.random.default_rng(0)
    if dtype == INT8:
        a, bt = (rng.integers(-127, 128, shape).astype(np.int8) for shape in [(m, k), (n, k)])
    else:
        a, bt = ((rng.standard_normal(shape) * 30).astype(ml_dtypes.float8_e4m3fn)
                 for shape in [(m, k), (n, k)])
    want = a.astype(np.float64) @ bt.astype(np.float64).T
    got = np.asarray(matmul(True)(jnp.asarray(a), jnp.asarray(bt)))
    assert got.dtype == acc_dtype
    if dtype == INT8:
        np.testing.assert_array_equal(got, want)
    else:  # e4m3 products are exact in f32; only the f32 sum rounds
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    jax.jit(matmul(False)).trace(jnp.asarray(a), jnp.asarray(bt)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("out_dtype", [E4M3, INT8], ids=["e4m3", "int8"])
def test_quantize_weights_per_expert_and_output_channel(out_dtype):
    num_experts, d_in, d_out = 3, 96, 40
    w = jax.random.normal(jax.random.key(4), (num_experts, d_in, d_out), jnp.float32)
    w = (w * jnp.logspace(-2, 2, d_out)).astype(jnp.bfloat16).at[1, :, 7].set(0)  # a dead column
    q, scales = pm.quant.quantize_weights(w, out_dtype=out_dtype)
    assert q.shape == w.shape and q.dtype == out_dtype and scales.shape == (num_experts, d_out)
    # numpy: each (expert, column) is a row of the formula.
    cols = np.asarray(w, np.float32).transpose(0, 2, 1).reshape(-1, d_in)
    n_rows = cols.shape[0]
    want_q, want_s = numpy_smoothquant(cols, np.ones((1, d_in), np.float32), np.arange(n_rows),
                                       np.zeros(n_rows, int), np.ones(n_rows, bool), out_dtype)
    got_q = np.asarray(q).transpose(0, 2, 1).reshape(-1, d_in)
    assert_bitwise(got_q, np.asarray(scales).reshape(-1), want_q, want_s)
    assert float(scales[1, 7]) == 0.0
    back = np.asarray(pm.quant.dequantize_weights(q, scales), np.float64)
    rel = np.abs(back - np.asarray(w, np.float64)) / np.asarray(scales, np.float64)[:, None, :].clip(1e-30)
    assert rel.max() <= (0.5 + 1e-5 if out_dtype == INT8 else 448 * 2.0**-4 + 1e-3)


def test_expert_activation_absmax_matches_a_loop_over_rows():
    num_tokens, d, num_experts = 30, 64, 6
    ks = jax.random.split(jax.random.key(5), 3)
    plan = assignment_plan(ks[0], num_tokens, num_experts, p=0.3, empty=(4,), extra=9)
    x = jax.random.normal(ks[1], (num_tokens, d), jnp.bfloat16)
    got = pm.quant.expert_activation_absmax(x, plan, rows_per_step=7)  # 7 does not divide P
    want = np.zeros((num_experts, d), np.float32)
    xs = np.abs(np.asarray(x, np.float32))
    experts, tokens = np.asarray(plan.expert_ids), np.asarray(plan.token_ids)
    for r in range(int(plan.num_rows)):
        want[experts[r]] = np.maximum(want[experts[r]], xs[tokens[r]])
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.all(np.asarray(got[4]) == 0)
    running = jnp.full((num_experts, d), 1.5, jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(pm.quant.expert_activation_absmax(x, plan, running)), np.maximum(want, 1.5))


def test_calibrate_smoothing_formula_and_equivalence():
    num_experts, d, n_out, alpha = 4, 64, 48, 0.6
    ks = jax.random.split(jax.random.key(6), 3)
    act = jnp.abs(jax.random.normal(ks[0], (num_experts, d))) * jnp.logspace(-1, 2, d)
    act = act.at[2, 5].set(0)  # a channel this expert never saw
    w = jax.random.normal(ks[1], (num_experts, d, n_out), jnp.float32) * 0.05
    w = w.at[1, 9, :].set(0)  # a dead input channel
    smooth, w_s = pm.quant.calibrate_smoothing(act, w, alpha=alpha)
    a64, wmax = np.asarray(act, np.float64), np.abs(np.asarray(w, np.float64)).max(axis=2)
    with np.errstate(divide="ignore"):
        f = np.where((a64 > 0) & (wmax > 0), a64**alpha / wmax ** (1 - alpha), 1.0)
    np.testing.assert_allclose(np.asarray(smooth, np.float64), 1 / f, rtol=1e-5)
    assert float(smooth[2, 5]) == 1.0 and float(smooth[1, 9]) == 1.0
    x = np.asarray(jax.random.normal(ks[2], (16, d)), np.float64)
    for e in range(num_experts):
        smoothed = (x * np.asarray(smooth[e], np.float64)) @ np.asarray(w_s[e], np.float64)
        np.testing.assert_allclose(smoothed, x @ np.asarray(w[e], np.float64), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="alpha must be a number in \\[0, 1\\], got 1.5"):
        pm.quant.calibrate_smoothing(act, w, alpha=1.5)
    with pytest.raises(ValueError, match="act_absmax must be \\[E, in\\]"):
        pm.quant.calibrate_smoothing(act[:, :32], w)


_on_hopper = (jax.devices()[0].platform == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "") == "9.0")


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper, reason="needs a Hopper GPU")
def test_kernel_without_smooth_scales_on_gpu():
    """The compiled kernel without smooth scales (each token quantized once, stored at every
    one of its rows, the next output row loaded before each store) at a production width:
    tokens with several rows (top-K) and padding rows, every row against numpy's smoothing
    by ones, bit for bit."""
    from pallas_moe.quant.kernel import smoothquant_kernel

    num_tokens, d, num_experts, k = 2048, 2048, 16, 4
    ks = jax.random.split(jax.random.key(8), 2)
    plan = pm.routing.token_rounding_plan(
        jax.random.normal(ks[0], (num_tokens, num_experts)), k, tile=128)
    x = special_x(ks[1], num_tokens, d)
    row_experts = jnp.minimum(plan.expert_ids[plan.rows_by_token], num_experts - 1)
    meta = (plan.token_row_offsets, plan.rows_by_token, row_experts, plan.num_rows)
    for out_dtype in (INT8, E4M3):
        q, s = jax.jit(lambda x, *m, od=out_dtype: smoothquant_kernel(
            x, None, *m, num_out_rows=plan.capacity, out_dtype=od))(x, *meta)
        ones = jnp.ones((num_experts, d), jnp.float32)
        assert_bitwise(q, s, *numpy_smoothquant(x, ones, *plan_rows(plan), out_dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", [
    SmoothQuantConfig(), SmoothQuantConfig(block_t=2),
    SmoothQuantConfig(vec=8), SmoothQuantConfig(x_per_row=True),
    SmoothQuantConfig(scale_rows_smem=2), SmoothQuantConfig(scale_rows_smem=3, block_t=2)],
    ids=["default", "bt2", "vec8", "x_per_row", "smem2", "smem3_bt2"])
@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_mosaic_kernel_matches_numpy_on_gpu(out_dtype, config):
    # Token rounding (padding rows) at a production width; every row, bit for bit. The
    # default rounds int8 by an f32 add (session 26; the only rounding since session 64).
    _kernel_matches_numpy_on_gpu(out_dtype, config, 2048, 2048, 16, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", [SmoothQuantConfig(), SmoothQuantConfig(scale_rows_smem=0)],
                         ids=["default", "smem0"])
@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_wide_rows_match_numpy_on_gpu(out_dtype, config):
    """DeepSeek-V3's width, where the default stages 2 smooth-scale rows in SMEM and widens
    X per row (and, against it, scale rows straight into registers): every row, bit for bit,
    token rounding (padding rows) and top-K ids."""
    assert SmoothQuantConfig().resolve_scale_rows_smem(7168) == 2
    _kernel_matches_numpy_on_gpu(out_dtype, config, 1024, 7168, 64, 8)


def _kernel_matches_numpy_on_gpu(out_dtype, config, num_tokens, d, num_experts, k):
    ks = jax.random.split(jax.random.key(7), 3)
    plan = pm.routing.token_rounding_plan(
        jax.random.normal(ks[0], (num_tokens, num_experts)), k, tile=128)
    x = special_x(ks[1], num_tokens, d)
    smooth = smooth_scales(ks[2], num_experts, d)
    q, s = plan_quant(out_dtype, "mosaic", config)(x, smooth, plan)
    assert_bitwise(q, s, *numpy_smoothquant(x, smooth, *plan_rows(plan), out_dtype))
    ids = jax.random.randint(ks[0], (num_tokens, k), 0, num_experts)
    q, s = pm.quant.moe_smoothquant_topk(x, smooth, ids, out_dtype=out_dtype, backend="mosaic",
                                         config=config)
    tokens = np.repeat(np.arange(num_tokens), k)
    assert_bitwise(q.reshape(-1, d), s.reshape(-1),
                   *numpy_smoothquant(x, smooth, tokens, np.asarray(ids).reshape(-1),
                                      np.ones(num_tokens * k, bool), out_dtype))



@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper, reason="needs a Hopper GPU")
def test_kernel_reciprocal_is_correctly_rounded_on_gpu():
    """The CSR kernel's `rcp.rn.f32` (interpret mode runs the jnp reciprocal instead) gives
    `correctly_rounded_reciprocal`'s bits, and numpy's `1 / s`, on every kind of input the
    kernel hands it: normal scales across the whole exponent range below 2^126 (random
    mantissas, powers of two, all-ones mantissas), NaN and inf."""
    from pallas_moe.quant.kernel import _rcp_rn
    from pallas_moe.quant.reference import correctly_rounded_reciprocal

    rng = np.random.default_rng(5)
    exponents = rng.integers(1, 253, 60000)  # biased exponents of normal f32 below 2^126
    bits = (exponents << 23) | rng.integers(0, 1 << 23, 60000)
    edges = [(e << 23) | m for e in (1, 2, 126, 127, 128, 200, 252) for m in (0, 1, (1 << 23) - 1)]
    values = np.concatenate([bits, edges]).astype(np.uint32).view(np.float32)
    values = np.concatenate([values, np.float32([np.nan, np.inf])])

    def body(v_ref, o_ref):
        i = jax.lax.axis_index("i")
        o_ref[i] = jnp.max(_rcp_rn(jnp.full((128,), v_ref[i], jnp.float32)))

    rcp = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(values.shape, jnp.float32),
                       grid=(values.size,), grid_names=("i",))
    got = np.asarray(jax.jit(rcp)(jnp.asarray(values)))
    want = np.asarray(jax.jit(correctly_rounded_reciprocal)(jnp.asarray(values)))
    numpy = np.float32(1) / values
    assert np.isnan(got[-2]) and np.isnan(want[-2])  # NaN payloads differ between platforms
    got, want, numpy = (np.delete(v, -2).view(np.uint32) for v in (got, want, numpy))
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:10]
    assert np.array_equal(got, numpy), np.flatnonzero(got != numpy)[:10]

# --- The row-block quantizer (contiguous grouped rows: A's re-quantization) ---------------

def row_block_case(key, num_rows, width, group_sizes, in_rows=None, dtype=jnp.bfloat16):
    """A [in_rows, width] with the special rows of `special_x` among real rows, NaN past
    `num_rows` (padding the kernel must not read into a real row), smooth scales, groups."""
    in_rows = num_rows if in_rows is None else in_rows
    ks = jax.random.split(key, 2)
    a = special_x(ks[0], in_rows, width, dtype=dtype, at=(0, 63, 64, 65, 130))
    a = jnp.where(jnp.arange(in_rows)[:, None] < num_rows, a, jnp.nan).astype(dtype)
    smooth = smooth_scales(ks[1], len(group_sizes), width)
    return a, smooth, jnp.asarray(group_sizes, jnp.int32)


def numpy_row_blocks(a, smooth, group_sizes, num_rows, out_rows, out_dtype):
    """The formula per grouped row r < num_rows with its expert's scale; zeros past it."""
    experts = np.searchsorted(np.cumsum(group_sizes), np.arange(out_rows), side="right")
    a_np = np.zeros((out_rows, a.shape[1]), np.float32)
    a_np[:num_rows] = np.asarray(a, np.float32)[:num_rows]
    s_np = np.ones((len(group_sizes), a.shape[1]), np.float32) if smooth is None else smooth
    return numpy_smoothquant(a_np, s_np, np.arange(out_rows), experts,
                             np.arange(out_rows) < num_rows, out_dtype)


def run_row_blocks(a, smooth, group_sizes, num_rows, out_rows, out_dtype, config, interpret=True):
    from pallas_moe.quant.kernel import quantize_row_blocks

    return quantize_row_blocks(a, smooth, group_sizes, jnp.int32(num_rows), num_out_rows=out_rows,
                               out_dtype=out_dtype, config=config, interpret=interpret)


@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
def test_row_blocks_match_numpy(out_dtype, smoothed):
    # 200 real rows in ragged groups (an empty expert, a group spanning three blocks, blocks
    # holding up to four experts), zero / largest-bf16 / sub-normal-scale rows, NaN padding
    # rows, and output rows past the input (320 > 256): every bit of Q and s.
    from pallas_moe.quant.kernel import RowBlockQuantConfig

    sizes = [3, 0, 150, 9, 38]
    a, smooth, gs = row_block_case(jax.random.key(11), 200, 256, sizes, in_rows=256)
    s_arg = smooth if smoothed else None
    q, s = run_row_blocks(a, s_arg, gs, 200, 320, out_dtype,
                          RowBlockQuantConfig(block_cols=128, num_stages=2, num_sms=3))
    assert_bitwise(q, s, *numpy_row_blocks(a, None if s_arg is None else np.asarray(smooth),
                                           sizes, 200, 320, out_dtype))


def test_row_blocks_no_races_one_stage_and_one_column_pass():
    from pallas_moe.quant.kernel import RowBlockQuantConfig

    sizes = [70, 0, 58]
    a, smooth, gs = row_block_case(jax.random.key(12), 128, 256, sizes, in_rows=130)
    for cfg in (RowBlockQuantConfig(block_cols=256, num_stages=1, num_sms=2),
                RowBlockQuantConfig(block_cols=128, num_stages=3, num_sms=2)):
        q, s = run_row_blocks(a, smooth, gs, 128, 192, E4M3, cfg,
                              interpret=plgpu.InterpretGPUParams(detect_races=True))
        assert not races_found()
        assert_bitwise(q, s, *numpy_row_blocks(a, np.asarray(smooth), sizes, 128, 192, E4M3))


def test_row_blocks_bad_inputs_raise():
    from pallas_moe.quant.kernel import RowBlockQuantConfig, quantize_row_blocks

    a = jnp.zeros((128, 256), jnp.bfloat16)
    gs = jnp.asarray([64, 64], jnp.int32)
    kw = dict(num_out_rows=128, out_dtype=E4M3)
    with pytest.raises(ValueError, match="num_out_rows=100 must be a multiple of 64"):
        quantize_row_blocks(a, None, gs, jnp.int32(128), num_out_rows=100, out_dtype=E4M3)
    with pytest.raises(ValueError, match=r"a.shape\[1\]=1536 must be a multiple of 128 whose"):
        quantize_row_blocks(jnp.zeros((128, 1536), jnp.bfloat16), None, gs, jnp.int32(1), **kw)
    with pytest.raises(ValueError, match="smooth_scales"):
        quantize_row_blocks(a, jnp.ones((3, 256), jnp.float32), gs, jnp.int32(1), **kw)
    with pytest.raises(TypeError, match="a must be bf16 or fp16"):
        quantize_row_blocks(a.astype(jnp.float32), None, gs, jnp.int32(1), **kw)
    with pytest.raises(ValueError, match="out_dtype must be int8 or float8_e4m3fn"):
        quantize_row_blocks(a, None, gs, jnp.int32(1), num_out_rows=128, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="config.block_cols=64 must be a positive multiple of 128"):
        RowBlockQuantConfig(block_cols=64)
    with pytest.raises(ValueError, match=r"a.shape\[1\]=384 must be a multiple of 256"):
        quantize_row_blocks(jnp.zeros((128, 384), jnp.bfloat16), None, gs, jnp.int32(1),
                            config=RowBlockQuantConfig(block_cols=256), **kw)


@pytest.mark.parametrize("width,smoothed", [(256, False), (512, False), (512, True), (1024, True)])
def test_row_blocks_lower_for_cuda_at_production_widths(width, smoothed):
    # A's widths n of the 7B / 30B shapes (and the widest the SMEM budget takes), P of 30B.
    from pallas_moe.quant.kernel import quantize_row_blocks
    from tests.cuda_target import h100_target

    rows, sds = 262144, jax.ShapeDtypeStruct

    def f(a, smooth, gs, nr):
        return quantize_row_blocks(a, smooth if smoothed else None, gs, nr, num_out_rows=rows,
                                   out_dtype=E4M3)

    with h100_target():
        jax.jit(f).trace(sds((rows, width), jnp.bfloat16), sds((128, width), jnp.float32),
                         sds((128,), jnp.int32), sds((), jnp.int32)).lower(
            lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
@pytest.mark.parametrize("width", [256, 512])
def test_row_blocks_match_numpy_on_gpu(out_dtype, width):
    # A plan's ragged groups at a production width, special and NaN padding rows, poisoned
    # outputs (a freed buffer of 0xff bytes: NaN scales, NaN e4m3 / -1 int8): every bit.
    from pallas_moe.quant.kernel import RowBlockQuantConfig

    plan = topk_plan(jax.random.normal(jax.random.key(5), (4096, 64)), 4)
    sizes = np.asarray(plan.group_sizes)
    rows = int(plan.num_rows) - 37  # the last block holds real and padding rows
    a, smooth, gs = row_block_case(jax.random.key(6), rows, width, list(sizes[:-1]) +
                                   [sizes[-1] - 37], in_rows=plan.capacity)
    junk = jnp.full((plan.capacity * width * 2,), 0xFF, jnp.uint8).block_until_ready()
    del junk
    for s_arg in (None, smooth):
        q, s = run_row_blocks(a, s_arg, gs, rows, plan.capacity + 64, out_dtype,
                              RowBlockQuantConfig(), interpret=False)
        assert_bitwise(q, s, *numpy_row_blocks(
            a, None if s_arg is None else np.asarray(smooth), list(np.asarray(gs)), rows,
            plan.capacity + 64, out_dtype))
