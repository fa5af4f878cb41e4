"""Aggregation kernel (deterministic CSR sum) in Mosaic GPU interpret mode vs jnp."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels.aggregate import AggregateConfig, aggregate, token_blocks
from pallas_moe.kernels.reference import aggregate_reference
from pallas_moe.routing import token_rounding_plan, topk_plan
from tests.test_kernels_common import assignment_plan, close, races_found

# resident_ctas=0: the configured 3 tokens per CTA even on these small grids (the rule that
# gives small grids fewer tokens per CTA has its own tests below).
CFG = AggregateConfig(block_t=3, block_d=256, vec=2, resident_ctas=0)


def check(plan, d, key, weighted=True, config=CFG, dtype=jnp.bfloat16, interpret=True):
    y = jax.random.normal(key, (plan.capacity, d), jnp.float32).astype(dtype)
    scores = plan.scores if weighted else None
    o = aggregate(y, plan.rows_by_token, plan.token_row_offsets, scores, config=config,
                  interpret=interpret)
    want = aggregate_reference(y, plan.rows_by_token, plan.token_row_offsets, scores)
    close(o, want, plan.num_tokens, tol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    return y, o


def test_weighted_sum_ragged_tokens_and_tokens_without_rows():
    # p=0.3 over 4 experts: tokens with 0..4 rows; T=31 is not a multiple of block_t.
    plan = assignment_plan(jax.random.key(40), 31, 4, extra=3)
    check(plan, 512, jax.random.key(41))


def test_unweighted_sum_serves_dx():
    plan = topk_plan(jax.random.normal(jax.random.key(42), (20, 6)), 3)
    check(plan, 256, jax.random.key(43), weighted=False, dtype=jnp.float32)


# CI time (an opt-in extra): test_numerics' aggregation test runs the kernel bitwise on token-
# rounding K=1 plans
@pytest.mark.slow
def test_token_rounding_plan_and_k1():
    plan = token_rounding_plan(jax.random.normal(jax.random.key(44), (40, 4)), 2, tile=8)
    check(plan, 256, jax.random.key(45))
    plan = topk_plan(jax.random.normal(jax.random.key(46), (16, 1)), 1)
    check(plan, 256, jax.random.key(47), config=AggregateConfig(block_t=4, block_d=128, vec=1))


def assert_race_free_and_bitwise_cfg(plan, d, key, config=CFG):
    """`config` run with race detection matches the reference, and writes the bits of `CFG`
    (3 tokens per CTA, one run of the kernel without race detection)."""
    params = plgpu.InterpretGPUParams(detect_races=True)
    y, o1 = check(plan, d, key, config=config, interpret=params)
    assert not races_found()
    o2 = aggregate(y, plan.rows_by_token, plan.token_row_offsets, plan.scores, config=CFG,
                   interpret=True)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))


def test_bitwise_reproducible_and_no_races():
    assert_race_free_and_bitwise_cfg(assignment_plan(jax.random.key(48), 12, 3, p=0.7), 256,
                                     jax.random.key(49))


def test_bad_block_raises():
    plan = topk_plan(jax.random.normal(jax.random.key(50), (8, 2)), 1)
    y = jnp.zeros((plan.capacity, 192), jnp.bfloat16)
    with pytest.raises(ValueError, match="d \\(y.shape\\[1\\]\\)=192 must be a multiple of 256"):
        aggregate(y, plan.rows_by_token, plan.token_row_offsets, config=CFG, interpret=True)
    with pytest.raises(ValueError, match="config.block_d=200 must be a multiple of 256"):
        aggregate(y, plan.rows_by_token, plan.token_row_offsets,
                  config=AggregateConfig(block_d=200, vec=2), interpret=True)


@pytest.mark.parametrize("num_tokens, block_t, col_blocks, resident, want", [
    (8, 4, 1, 1056, (1, 8)),  # a decode batch: one token per CTA
    (1024, 4, 1, 1056, (1, 1024)),
    (2048, 4, 1, 1056, (2, 1024)),  # the fewest tokens per CTA within 1056 CTAs
    (4096, 4, 1, 1056, (4, 1024)),
    (24576, 4, 1, 1056, (4, 6144)),  # training sizes keep block_t
    (4096, 4, 7, 1056, (4, 1024)),  # 7 column blocks (d = 7168)
    (300, 4, 7, 1056, (2, 150)),
    (8, 4, 1, 0, (4, 2)),  # resident_ctas=0: always block_t
    (65535 * 5, 4, 1, 1056, (5, 65535)),  # more where the grid's y dimension would overflow
])
def test_token_blocks(num_tokens, block_t, col_blocks, resident, want):
    """Tokens per CTA: `block_t`, fewer while the grid would stay under `resident_ctas`
    CTAs (a CTA's rows are one chain of dependent loads), more past `MAX_GRID_Y`."""
    assert token_blocks(num_tokens, block_t, col_blocks, resident) == want


def test_small_grids_take_fewer_tokens_per_cta_with_the_same_bits():
    """The default `resident_ctas` gives a 12-token batch one token per CTA (12 CTAs per
    column block instead of 4 of three tokens): the same bits as three tokens per CTA, and
    no races."""
    plan = assignment_plan(jax.random.key(52), 12, 3, p=0.7)
    spread = AggregateConfig(block_t=3, block_d=256, vec=2)
    assert token_blocks(12, 3, 2, spread.resident_ctas) == (1, 12)
    assert_race_free_and_bitwise_cfg(plan, 512, jax.random.key(53), spread)



@pytest.mark.parametrize("aggregation", ["fp32", "bf16_per_expert"])
def test_rows_in_flight_write_the_one_row_at_a_time_bits(aggregation):
    """Rows loaded in groups before their sums (`rows_in_flight`: here groups of 3, so
    tokens of 0-10 rows take whole groups and a remainder) give the bits of one row at a
    time, in both rounding orders, against the reference too; no races."""
    plan = assignment_plan(jax.random.key(55), 10, 10, p=0.5, empty=(4,))
    counts = np.diff(np.asarray(plan.token_row_offsets))
    assert counts.max() >= 7 and np.any(counts % 3), counts  # groups and remainders
    y = jax.random.normal(jax.random.key(56), (plan.capacity, 256), jnp.float32).astype(
        jnp.bfloat16)
    outs = []
    for rows, interpret in ((3, plgpu.InterpretGPUParams(detect_races=True)), (1, True)):
        config = AggregateConfig(block_t=2, block_d=256, vec=2, rows_in_flight=rows)
        outs.append(np.asarray(aggregate(y, plan.rows_by_token, plan.token_row_offsets,
                                         plan.scores, aggregation=aggregation, config=config,
                                         interpret=interpret)))
        if rows == 3:
            assert not races_found()
    np.testing.assert_array_equal(outs[0], outs[1])
    want = aggregate_reference(y, plan.rows_by_token, plan.token_row_offsets, plan.scores)
    close(outs[0], want, plan.num_tokens)


@pytest.mark.parametrize("field, value", [("resident_ctas", -1), ("rows_in_flight", 0)])
def test_bad_config_field_raises(field, value):
    plan = topk_plan(jax.random.normal(jax.random.key(54), (8, 2)), 1)
    y = jnp.zeros((plan.capacity, 256), jnp.bfloat16)
    config = AggregateConfig(block_d=256, vec=2, **{field: value})
    with pytest.raises(ValueError, match=f"config.{field}={value} must be >= "):
        aggregate(y, plan.rows_by_token, plan.token_row_offsets, config=config, interpret=True)



@pytest.mark.parametrize("num_tokens, d, k", [
    (24576, 1536, 8),  # 7B training: 5 rows a group (3 loads a row)
    (32768, 4096, 8),  # 30B: 4 rows a group (block_d = 4096)
    (8, 2048, 8),  # a decode batch: one token per CTA, 8 rows a group
    (4096, 7168, 8),  # 7 column blocks
    (2048, 2880, 4),  # gpt-oss-20b's width padded to 3072: two tokens per CTA
])
def test_default_configs_lower_for_cuda(num_tokens, d, k):
    """Each width's default aggregation (`ForwardConfig.for_shape(...).aggregate`: grouped
    row loads, the small-grid rule) lowers for cuda at production sizes."""
    from pallas_moe.kernels.moe_forward import ForwardConfig, aggregate_width
    from tests.cuda_target import h100_target

    config = ForwardConfig.for_shape(d, 768).aggregate
    rows = num_tokens * k
    sds = jax.ShapeDtypeStruct
    with h100_target():
        jax.jit(lambda y, r, o, s: aggregate(y, r, o, s, config=config)).trace(
            sds((rows, aggregate_width(d)), jnp.bfloat16), sds((rows,), jnp.int32),
            sds((num_tokens + 1,), jnp.int32), sds((rows,), jnp.float32),
        ).lower(lowering_platforms=("cuda",))
