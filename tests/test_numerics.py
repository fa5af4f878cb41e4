"""Aggregation modes (`pm.Numerics`): each backend bitwise against an independent numpy
reference of the mode's rounding order; their backward; the other switches; determinism.

The reference (`aggregate_np`) walks each token's rows found from `token_ids` and
`group_sizes` (not the plan's CSR arrays), sorted by expert, in numpy float32 with explicit
bf16 roundings (ml_dtypes): every step is one IEEE operation, so the order is exactly the
one the mode's documentation states.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_moe as pm
from pallas_moe.kernels.aggregate import AggregateConfig, aggregate
from pallas_moe.numerics import AGGREGATIONS, Numerics, round_bf16
from pallas_moe.ops.xla import aggregate_rows
from pallas_moe.routing import plan_from_assignment, token_rounding_plan, topk_plan

AGG_CFG = AggregateConfig(block_t=3, block_d=256, vec=2)


def bf16(v) -> np.ndarray:
    """Rounds float32 values to bf16 (nearest even) and back to float32."""
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def rows_of_tokens(plan) -> list[list[int]]:
    """Each token's grouped rows in ascending expert order, from token_ids and group_sizes."""
    sizes = np.asarray(plan.group_sizes)
    token_ids = np.asarray(plan.token_ids)
    rows: list[list[tuple[int, int]]] = [[] for _ in range(plan.num_tokens)]
    r = 0
    for e, size in enumerate(sizes):
        for _ in range(size):
            rows[token_ids[r]].append((e, r))
            r += 1
    return [[row for _, row in sorted(pairs)] for pairs in rows]


def aggregate_np(y, plan, mode: str) -> np.ndarray:
    """float32 [T, d] holding the mode's result (bf16 values for the bf16 modes)."""
    y = np.asarray(jnp.asarray(y, jnp.float32))
    scores = np.asarray(plan.scores, np.float32)
    out = np.zeros((plan.num_tokens, y.shape[1]), np.float32)
    for t, rows in enumerate(rows_of_tokens(plan)):
        acc = np.zeros(y.shape[1], np.float32)
        for r in rows:
            if mode == "fp32":
                acc = acc + y[r] * scores[r]
            elif mode == "bf16_per_expert":
                acc = bf16(acc + bf16(y[r] * scores[r]))
            else:  # bf16_scores
                acc = bf16(acc + bf16(y[r] * bf16(scores[r])))
        out[t] = acc
    return out


def assert_bitwise(got, want_f32: np.ndarray, dtype):
    """Equal bit patterns (signs of zeros included) after casting the reference to dtype."""
    got = np.asarray(got)
    want = np.asarray(jnp.asarray(want_f32).astype(dtype))
    assert got.dtype == want.dtype
    bits = np.uint16 if got.dtype.itemsize == 2 else np.uint32
    diff = got.view(bits) != want.view(bits)
    assert not diff.any(), f"{int(diff.sum())} of {diff.size} elements differ"


def ragged_plan(key, num_tokens=23, num_experts=5, extra=7):
    """Ragged assignment with tokens of 0..E rows, an empty expert and padding rows."""
    k1, k2 = jax.random.split(key)
    sel = jax.random.bernoulli(k1, 0.45, (num_tokens, num_experts)).at[:, 2].set(False)
    sel = sel.at[3].set(False)  # token 3 has no rows at all
    weights = jax.random.uniform(k2, (num_tokens, num_experts), jnp.float32, 0.05, 1.0)
    return plan_from_assignment(sel, weights, sel, num_tokens * num_experts + extra)


def token_rounding_with_empty_token():
    """Token rounding (tile 8, rounding down) with padding rows and a token left without rows."""
    logits = jax.random.normal(jax.random.key(7), (40, 4)).at[:, 0].add(0.8)
    plan = token_rounding_plan(logits, 1, tile=8, rounding="down")
    assert int(plan.num_rows) < plan.capacity  # padding rows
    assert np.any(np.asarray(plan.rows_per_token) == 0)  # a token whose rows all went
    return plan


PLANS = {
    "ragged": lambda: ragged_plan(jax.random.key(3)),
    "token_rounding": token_rounding_with_empty_token,
    "topk": lambda: topk_plan(jax.random.normal(jax.random.key(5), (19, 6)), 3),
}


def random_rows(plan, d, seed=11):
    # Wide dynamic range so that bf16 rounding of partial sums actually bites.
    k1, k2 = jax.random.split(jax.random.key(seed))
    scale = jnp.exp2(jax.random.randint(k2, (plan.capacity, 1), -6, 6).astype(jnp.float32))
    return (jax.random.normal(k1, (plan.capacity, d)) * scale).astype(jnp.bfloat16)


@pytest.mark.parametrize("plan_name", sorted(PLANS))
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_bitwise_against_reference_of_its_order(mode, plan_name):
    plan = PLANS[plan_name]()
    y = random_rows(plan, 256)
    want = aggregate_np(y, plan, mode)

    kernel = aggregate(
        y, plan.rows_by_token, plan.token_row_offsets, plan.scores, aggregation=mode,
        out_dtype=jnp.bfloat16, config=AGG_CFG, interpret=True,
    )
    assert_bitwise(kernel, want, jnp.bfloat16)
    tiles = jax.jit(aggregate_rows, static_argnames=("aggregation", "block_m", "tiles_per_step"))(
        y, plan, aggregation=mode, block_m=4, tiles_per_step=3
    )
    assert_bitwise(tiles, want, jnp.float32)
    if plan_name == "topk":
        slots = aggregate_rows(y, plan, mode, rows_per_token=3)
        assert_bitwise(slots, want, jnp.float32)


def test_modes_round_differently():
    # The bitwise test above could not fail if every mode computed the same thing.
    plan = PLANS["ragged"]()
    y = random_rows(plan, 256)
    results = {m: aggregate_np(y, plan, m) for m in AGGREGATIONS}
    fp32 = bf16(results["fp32"])
    assert np.any(fp32 != results["bf16_per_expert"])
    assert np.any(results["bf16_per_expert"] != results["bf16_scores"])
    empty = np.asarray(plan.rows_per_token) == 0
    for m, r in results.items():  # a token without rows is +0 in every mode
        assert np.all(r[empty] == 0) and not np.any(np.signbit(r[empty])), m
