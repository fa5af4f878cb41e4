"""Down-proj kernel (grouped GEMM over aligned row tiles) in Mosaic GPU interpret mode vs jnp."""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels.down_proj import DownProjConfig, down_proj
from pallas_moe.kernels.reference import down_proj_reference
from pallas_moe.routing import token_rounding_plan, topk_plan
from tests.test_kernels_common import (
    assert_untouched, assignment_plan, close, races_found, random_weights,
)

SMALL = DownProjConfig(block_m=64, block_n=64, num_stages=2)


def run_and_check(plan, n, d, num_experts, config, key, interpret=True):
    ka, kw = jax.random.split(key)
    a = jax.random.normal(ka, (plan.capacity, n), jnp.float32).astype(jnp.bfloat16)
    _, w2 = random_weights(kw, num_experts, d, n)
    y = down_proj(a, plan.group_sizes, w2, config=config, interpret=interpret)
    rows = int(plan.num_rows)
    close(y, down_proj_reference(a, plan.group_sizes, w2), rows)
    assert_untouched(y, rows)


@pytest.mark.slow  # the per-tile kernel is also covered by test_no_races[per_tile]
def test_ragged_groups_with_empty_experts():
    plan = assignment_plan(jax.random.key(20), 45, 5, empty=(0, 3), extra=7)
    run_and_check(plan, 128, 128, 5, SMALL, jax.random.key(21))


def test_groups_crossing_aligned_blocks_wide_tile():
    # Block 128 rows, 4 stages over n=256: tiles start mid-block and span block edges.
    plan = assignment_plan(jax.random.key(22), 90, 3, p=0.7)
    run_and_check(plan, 256, 128, 3, DownProjConfig(block_m=128, block_n=128, num_stages=3),
                  jax.random.key(23))


def test_one_expert_all_tokens_and_e1_k1():
    plan = assignment_plan(jax.random.key(24), 70, 3, only=1)
    run_and_check(plan, 64, 64, 3, SMALL, jax.random.key(25))
    plan = topk_plan(jax.random.normal(jax.random.key(26), (24, 1)), 1)
    run_and_check(plan, 64, 64, 1, SMALL, jax.random.key(27))


def test_token_rounding_plan_with_padding_rows():
    plan = token_rounding_plan(jax.random.normal(jax.random.key(28), (48, 4)), 2, tile=8)
    run_and_check(plan, 64, 192, 4, DownProjConfig(block_m=64, block_n=192, num_stages=2),
                  jax.random.key(29))


PERSISTENT = DownProjConfig(block_m=64, block_n=64, num_stages=3, num_sms=3)
# The forward's default on H100: persistent, 128-row tiles split between the two consumers.
PERSISTENT_SPLIT_M = DownProjConfig(block_m=128, block_n=64, num_stages=3, num_sms=3)


@pytest.mark.parametrize(
    "config", [SMALL, PERSISTENT, PERSISTENT_SPLIT_M], ids=["per_tile", "ping_pong", "split_m"]
)
def test_no_races(config):
    plan = assignment_plan(jax.random.key(30), 40, 3, p=0.5)
    run_and_check(plan, 128, 128, 3, config, jax.random.key(31),
                  interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()


@pytest.mark.parametrize("config", [PERSISTENT, PERSISTENT_SPLIT_M], ids=["ping_pong", "split_m"])
def test_persistent_ragged_with_empty_experts_and_padding(config):
    # 3 CTAs walk 2 column blocks x the real tiles (consumers alternate items, or split
    # each 128-row tile); groups start and end anywhere inside the aligned blocks.
    plan = token_rounding_plan(jax.random.normal(jax.random.key(32), (75, 5)), 2, tile=8)
    run_and_check(plan, 256, 128, 5, config, jax.random.key(33))


@pytest.mark.parametrize(
    "n, d, config, match",
    [
        (96, 64, SMALL, "n \\(w_down.shape\\[1\\]\\)=96 must be a multiple of 64"),
        (64, 160, SMALL, "d \\(w_down.shape\\[2\\]\\)=160 must be a multiple of 64"),
        (64, 128, DownProjConfig(block_n=320), "config.block_n=320 must be at most 256"),
        (64, 192, DownProjConfig(block_n=128), "d \\(w_down.shape\\[2\\]\\)=192 must be a multiple of 128"),
    ],
)
def test_bad_dims_raise_naming_the_argument(n, d, config, match):
    a = jnp.zeros((16, n), jnp.bfloat16)
    w2 = jnp.zeros((2, n, d), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        down_proj(a, jnp.zeros((2,), jnp.int32), w2, config=config, interpret=True)
