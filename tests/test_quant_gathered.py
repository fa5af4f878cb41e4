"""The gathered row-block SmoothQuant kernel (`pallas_moe/quant/gathered.py`) against the
numpy formula of `tests/test_quant.py`, bit for bit: interpret mode (the TMA loader; one
run under the race detector), lowering for the H100 at the production widths (both
loaders), and on a Hopper GPU (`-m gpu`).

Interpret mode poisons fresh outputs (int8 127, e4m3 and the f32 scales NaN), so a row the
kernel forgot to write fails the comparison.
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
from pallas_moe.quant.gathered import (
    SMEM_LIMIT_BYTES, GatheredQuantConfig, gathered_fits, gathered_smem_bytes,
    quantize_gathered_rows,
)
from pallas_moe.routing import token_rounding_plan, topk_plan
from tests.test_kernels_common import assignment_plan, races_found
from tests.test_quant import (
    E4M3, INT8, assert_bitwise, numpy_smoothquant, plan_rows, smooth_scales, special_x,
)

_on_hopper = (jax.devices()[0].platform == "gpu"
              and getattr(jax.devices()[0], "compute_capability", "") == "9.0")


def nan_padding(plan, x, nan_token):
    """The plan with its padding rows pointing at `nan_token`, whose x row is NaN (a token
    no real row reads): padding rows must still come out Q = 0, s = 0."""
    rows = np.asarray(plan.token_ids).copy()
    real = int(plan.num_rows)
    assert nan_token not in rows[:real]
    rows[real:] = nan_token
    return dataclasses.replace(plan, token_ids=jnp.asarray(rows)), x.at[nan_token].set(jnp.nan)


def gathered_op(out_dtype, config, detect_races=False):
    # Not under jax.jit: a jitted interpret-mode kernel whose warpgroups wait on each other
    # can starve on this 2-core machine's XLA:CPU threads (the eager call runs the same).
    params = plgpu.InterpretGPUParams(detect_races=detect_races)
    return functools.partial(pm.quant.moe_smoothquant, out_dtype=out_dtype,
                             backend="interpret", config=config, interpret_params=params)


# numpy's cast of the NaN padding rows before they are zeroed warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_gathered_matches_numpy_on_a_ragged_plan(out_dtype):
    # Ragged groups, an empty expert, tokens with 0..4 rows, 21 padding rows pointing at a
    # NaN token; zero / largest-bf16 / sub-normal-scale rows. 2 bands of 128 columns
    # (R = 32 real rows per block), 3 chunk slots (the ring wraps), 3 CTAs.
    num_tokens, d, num_experts = 40, 256, 5
    ks = jax.random.split(jax.random.key(30), 3)
    plan = assignment_plan(ks[0], num_tokens, num_experts, p=0.3, empty=(2,), extra=21)
    rows_per_token = np.asarray(plan.rows_per_token)
    assert rows_per_token.min() == 0 and rows_per_token.max() >= 3
    special = tuple(np.flatnonzero(rows_per_token)[:5])
    x = special_x(ks[1], num_tokens, d, at=special)
    plan, x = nan_padding(plan, x, int(np.flatnonzero(rows_per_token == 0)[0]))
    smooth = smooth_scales(ks[2], num_experts, d)
    cfg = GatheredQuantConfig(parts=2, block_cols=128, num_slots=3, num_sms=3)
    q, s = gathered_op(out_dtype, cfg)(x, smooth, plan)
    assert q.shape == (plan.capacity, d) and s.dtype == jnp.float32
    assert_bitwise(q, s, *numpy_smoothquant(x, smooth, *plan_rows(plan), out_dtype))
    rows = int(plan.num_rows)
    assert rows < plan.capacity and np.all(np.asarray(s[rows:]) == 0)


def test_gathered_token_rounding_plan_tail_block_and_tiny_experts():
    # Token rounding (padding rows), fp16 input, smooth scales above 1, one band of two
    # chunks (R = 64) in grouped order; P = 80 is not a multiple of 64, so the last block
    # is stored row by row. Tiny experts put up to five experts in one block (the scale
    # rows of experts strictly inside a block come from global memory).
    num_tokens, d, num_experts, k = 24, 256, 6, 2
    ks = jax.random.split(jax.random.key(31), 3)
    logits = jax.random.normal(ks[0], (num_tokens, num_experts))
    plan = token_rounding_plan(logits, k, tile=4, rounding="nearest")
    assert plan.capacity % 64 and int(plan.num_rows) < plan.capacity
    sizes = np.asarray(plan.group_sizes)
    assert (sizes < 16).sum() >= 2, sizes
    x = special_x(ks[1], num_tokens, d, jnp.float16)
    smooth = smooth_scales(ks[2], num_experts, d, high=8.0)
    cfg = GatheredQuantConfig(parts=1, block_cols=128, num_slots=2, num_sms=1,
                              token_order=False)
    q, s = gathered_op(E4M3, cfg)(x, smooth, plan)
    assert_bitwise(q, s, *numpy_smoothquant(x, smooth, *plan_rows(plan), E4M3))


def test_gathered_no_races_bands_and_ring():
    # The race detector watches two warpgroups sharing each block (one chunk each, two ring
    # slots each: the ring wraps), the row maxima's round trip between them and across 4
    # bands (R = 16), the metadata ring, the Q tiles and a tail block (P = 87 rows); 2 CTAs
    # of 3 blocks each.
    num_tokens, d, num_experts = 16, 1024, 4
    ks = jax.random.split(jax.random.key(32), 3)
    plan = assignment_plan(ks[0], num_tokens, num_experts, p=0.6, empty=(1,), extra=23)
    assert plan.capacity == 87
    x = special_x(ks[1], num_tokens, d, at=(0, 1, 2, 3, 4))
    smooth = smooth_scales(ks[2], num_experts, d)
    cfg = GatheredQuantConfig(parts=4, block_cols=128, warpgroups=2, num_slots=4, num_sms=2)
    q, s = gathered_op(INT8, cfg, detect_races=True)(x, smooth, plan)
    assert not races_found()
    assert_bitwise(q, s, *numpy_smoothquant(x, smooth, *plan_rows(plan), INT8))


def test_gathered_without_smooth_scales_equals_ones():
    num_tokens, d, num_experts = 20, 256, 3
    ks = jax.random.split(jax.random.key(33), 2)
    plan = assignment_plan(ks[0], num_tokens, num_experts, p=0.5, extra=5)
    x = special_x(ks[1], num_tokens, d)
    cfg = GatheredQuantConfig(parts=2, num_slots=2, num_sms=2)
    q, s = quantize_gathered_rows(x, None, plan.token_ids, plan.group_sizes, plan.num_rows,
                                  num_out_rows=plan.capacity, out_dtype=E4M3, config=cfg,
                                  interpret=True)
    ones = jnp.ones((num_experts, d), jnp.float32)
    assert_bitwise(q, s, *numpy_smoothquant(x, ones, *plan_rows(plan), E4M3))


def test_moe_smoothquant_runs_the_gathered_kernel_when_configured():
    # The CSR kernel stays the default (it measured faster on the H100, docs/quant.md); a
    # GatheredQuantConfig selects the gathered kernel, for widths it fits.
    plan = topk_plan(jnp.zeros((8, 4)), 2)
    smooth = jnp.ones((4, 256), jnp.float32)

    def names(x, sm, **kw):
        return str(jax.make_jaxpr(functools.partial(
            pm.quant.moe_smoothquant, backend="interpret", **kw))(x, sm, plan))

    x = jnp.ones((8, 256), jnp.bfloat16)
    assert "moe_smoothquant_gathered" not in names(x, smooth)
    assert "moe_smoothquant_gathered" in names(x, smooth, config=GatheredQuantConfig())
    assert "moe_smoothquant_gathered" in names(
        x, smooth, config=GatheredQuantConfig.for_width(256))
    # 2944 = 23 * 128: no band count cuts it into whole 128-column chunks.
    wide = jnp.ones((8, 2944), jnp.bfloat16)
    assert not gathered_fits(2944)
    with pytest.raises(ValueError, match="d=2944: no parts"):
        names(wide, jnp.ones((4, 2944), jnp.float32), config=GatheredQuantConfig())
    assert "moe_smoothquant_gathered" not in names(wide, jnp.ones((4, 2944), jnp.float32))


def test_default_configs_fit_smem_at_production_widths():
    want_parts = {1536: 2, 2048: 2, 4096: 4, 7168: 8}
    for d, parts in want_parts.items():
        cfg = GatheredQuantConfig.for_width(d)
        assert cfg.parts == parts and gathered_fits(d)
        assert gathered_smem_bytes(d, cfg) <= SMEM_LIMIT_BYTES
        for out in (INT8, E4M3):
            assert gathered_smem_bytes(d, cfg, out_bytes=out.itemsize) <= SMEM_LIMIT_BYTES
    assert gathered_fits(256) and not gathered_fits(192) and not gathered_fits(8192)


def test_gathered_bad_inputs_raise():
    x = jnp.zeros((8, 256), jnp.bfloat16)
    ids, sizes, n = jnp.zeros((16,), jnp.int32), jnp.asarray([8, 8], jnp.int32), jnp.int32(16)
    sm = jnp.ones((2, 256), jnp.float32)
    kw = dict(num_out_rows=16, out_dtype=INT8,
              config=GatheredQuantConfig(parts=1, warpgroups=1, num_slots=2))
    run = quantize_gathered_rows
    with pytest.raises(ValueError, match=r"config.parts=3 must be one of \(1, 2, 4, 8\)"):
        GatheredQuantConfig(parts=3)
    with pytest.raises(ValueError, match="config.block_cols=64 must be a positive multiple of 128"):
        GatheredQuantConfig(block_cols=64)
    with pytest.raises(ValueError, match="config.loader must be one of"):
        GatheredQuantConfig(loader="ldg")
    with pytest.raises(ValueError, match="config.num_slots=0 must be >= 1"):
        GatheredQuantConfig(num_slots=0)
    with pytest.raises(ValueError, match="config.num_sms=0 must be >= 1"):
        GatheredQuantConfig(num_sms=0)
    with pytest.raises(ValueError, match="config.num_slots=1 must be at least the 2 chunks"):
        run(x, sm, ids, sizes, n, num_out_rows=16, out_dtype=INT8,
            config=GatheredQuantConfig(parts=1, warpgroups=1, num_slots=1))
    with pytest.raises(ValueError, match="config.warpgroups=5 must be 1 to 4"):
        GatheredQuantConfig(warpgroups=5)
    with pytest.raises(ValueError, match="config.num_slots=3 must be a multiple of 2"):
        run(x, sm, ids, sizes, n, num_out_rows=16, out_dtype=INT8,
            config=GatheredQuantConfig(parts=1, warpgroups=2, num_slots=3))
    with pytest.raises(ValueError, match=r"the chunks of a block .*=2 must be a multiple of 3"):
        run(x, sm, ids, sizes, n, num_out_rows=16, out_dtype=INT8,
            config=GatheredQuantConfig(parts=1, warpgroups=3))
    with pytest.raises(ValueError, match=r"config.num_slots=40 chunk slots need \d+ bytes of SMEM"):
        run(jnp.zeros((8, 4096), jnp.bfloat16), jnp.ones((2, 4096), jnp.float32), ids, sizes, n,
            num_out_rows=16, out_dtype=INT8, config=GatheredQuantConfig(parts=4, num_slots=40))
    with pytest.raises(ValueError, match=r"d \(x.shape\[1\]\)=256 must be a multiple of 512"):
        run(x, sm, ids, sizes, n, num_out_rows=16, out_dtype=INT8,
            config=GatheredQuantConfig(parts=4))
    with pytest.raises(ValueError, match="d=8192: no parts"):
        GatheredQuantConfig.for_width(8192)
    with pytest.raises(TypeError, match="x must be bf16 or fp16"):
        run(x.astype(jnp.float32), sm, ids, sizes, n, **kw)
    with pytest.raises(ValueError, match="x must be"):
        run(x[0], sm, ids, sizes, n, **kw)
    with pytest.raises(ValueError, match="smooth_scales"):
        run(x, sm[:, :128], ids, sizes, n, **kw)
    with pytest.raises(TypeError, match="smooth_scales must have dtype float32"):
        run(x, sm.astype(jnp.bfloat16), ids, sizes, n, **kw)
    with pytest.raises(ValueError, match="token_ids must be"):
        run(x, sm, ids[None], sizes, n, **kw)
    with pytest.raises(ValueError, match="group_sizes must be"):
        run(x, sm, ids, sizes[None], n, **kw)
    with pytest.raises(ValueError, match="num_out_rows must be a positive int"):
        run(x, sm, ids, sizes, n, num_out_rows=0, out_dtype=INT8)
    with pytest.raises(ValueError, match="out_dtype must be int8 or float8_e4m3fn"):
        run(x, sm, ids, sizes, n, num_out_rows=16, out_dtype=jnp.bfloat16)
    plan = topk_plan(jnp.zeros((8, 2)), 1)
    with pytest.raises(TypeError, match="config must be None, a GatheredQuantConfig"):
        pm.quant.moe_smoothquant(x, sm, plan, backend="interpret", config="fast")
    with pytest.raises(ValueError, match=r"d \(x.shape\[1\]\)=384 must be a multiple of 256"):
        pm.quant.moe_smoothquant(jnp.zeros((8, 384), jnp.bfloat16), jnp.ones((2, 384)), plan,
                                 backend="interpret", config=GatheredQuantConfig(parts=2))


def _lower_gathered(num_tokens, num_experts, k, d, out_dtype, config):
    from tests.cuda_target import h100_target

    sds = jax.ShapeDtypeStruct
    plan = jax.eval_shape(lambda l: topk_plan(l, k), sds((num_tokens, num_experts), jnp.float32))
    f = functools.partial(pm.quant.moe_smoothquant, out_dtype=out_dtype, backend="mosaic",
                          config=config)
    with h100_target():  # the AOT target `backend="mosaic"`'s device check reads
        text = jax.jit(f).trace(sds((num_tokens, d), jnp.bfloat16),
                                sds((num_experts, d), jnp.float32), plan).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "moe_smoothquant_gathered" in text


@pytest.mark.parametrize("d,num_tokens", [(1536, 24576), (4096, 32768)], ids=["7b", "30b"])
@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
def test_gathered_lowers_for_cuda_at_7b_and_30b(d, num_tokens, out_dtype):
    # The production config (`for_width`, the cp.async loader) at the 7B and 30B shapes.
    _lower_gathered(num_tokens, 128, 8, d, out_dtype, GatheredQuantConfig.for_width(d))


@pytest.mark.parametrize("d,loader", [(2048, "tma"), (7168, "cp_async")])
def test_gathered_lowers_for_cuda_at_other_widths(d, loader):
    _lower_gathered(8192, 256, 8, d, E4M3, GatheredQuantConfig.for_width(d, loader=loader))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
@pytest.mark.skipif(not _on_hopper, reason="needs a Hopper GPU")
@pytest.mark.parametrize("out_dtype", [INT8, E4M3], ids=["int8", "e4m3"])
@pytest.mark.parametrize("d", [1536, 4096])
def test_gathered_matches_numpy_on_gpu(out_dtype, d):
    # Fresh random data, a token-rounding plan (padding rows, pointing at a NaN token) at a
    # production width, outputs poisoned beforehand (a freed buffer of 0xff bytes: NaN
    # scales, NaN e4m3 / -1 int8): every row bit for bit against numpy, with both loaders.
    num_tokens, num_experts, k = 2048, 16, 4
    ks = jax.random.split(jax.random.key(34 + d), 3)
    plan = token_rounding_plan(jax.random.normal(ks[0], (num_tokens, num_experts)), k, tile=128)
    x = special_x(ks[1], num_tokens, d)
    rows_per_token = np.asarray(plan.rows_per_token)
    if (rows_per_token == 0).any():
        plan, x = nan_padding(plan, x, int(np.flatnonzero(rows_per_token == 0)[0]))
    smooth = smooth_scales(ks[2], num_experts, d)
    want = numpy_smoothquant(x, smooth, *plan_rows(plan), out_dtype)
    for loader in ("cp_async", "tma"):
        cfg = GatheredQuantConfig.for_width(d, loader=loader)
        f = jax.jit(functools.partial(pm.quant.moe_smoothquant, out_dtype=out_dtype,
                                      backend="mosaic", config=cfg))
        junk = jnp.full((plan.capacity * d * 2,), 0xFF, jnp.uint8).block_until_ready()
        del junk
        q, s = f(x, smooth, plan)
        assert_bitwise(q, s, *want)
