"""The per-plan tile schedules (`tile_schedule`, `tile_meta`, `aligned_tile_meta`,
`k_block_meta`) against the formulas they replaced: binary searches (`jnp.searchsorted`'s
default loop) and sorts. The new ones are one fused comparison each and closed forms; they
must give the same tiles on every entry a kernel reads (for the aligned tiles, the real
ones: the kernels stop at `num_real = sum(num_rows > 0)`), across one expert, empty
experts, skew and capacities that are not a multiple of the block.
"""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp

from pallas_moe.kernels import _common
from pallas_moe.kernels.weight_grad import k_block_meta
from pallas_moe.routing.plan import count_at_most, tile_schedule

# (E, capacity, block): few shapes, so the jitted programs are reused across examples.
SHAPES = [(1, 37, 8), (5, 300, 64), (6, 129, 8), (64, 1000, 64)]


def reference_tile_experts(group_sizes, capacity, block_m):
    """`tile_schedule`'s expert, row_start, row_end by a binary search (the previous way)."""
    num_experts = group_sizes.shape[0]
    n_tiles = capacity // block_m + num_experts
    tiles_per_expert = (group_sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles_per_expert, dtype=jnp.int32)
    tile_ids = jnp.arange(n_tiles, dtype=jnp.int32)
    expert = jnp.searchsorted(tile_ends, tile_ids, side="right").astype(jnp.int32)
    last_nonempty = jnp.max(jnp.where(group_sizes > 0, jnp.arange(num_experts), 0)).astype(jnp.int32)
    is_real = tile_ids < tile_ends[-1]
    expert = jnp.where(is_real, jnp.minimum(expert, num_experts - 1), last_nonempty)
    group_starts = jnp.cumsum(group_sizes, dtype=jnp.int32) - group_sizes
    row_start = group_starts[expert] + (tile_ids - (tile_ends - tiles_per_expert)[expert]) * block_m
    row_end = jnp.minimum(row_start + block_m, group_starts[expert] + group_sizes[expert])
    num_rows = jnp.sum(group_sizes)
    return expert, jnp.where(is_real, row_start, num_rows), jnp.where(is_real, row_end, num_rows)


def reference_aligned_tiles(group_sizes, capacity, block_m):
    """`aligned_tile_meta`'s expert, row_start, num_rows by sorting the cuts (the previous way)."""
    num_experts = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    total = ends[-1]
    num_blocks = -(-capacity // block_m)
    cuts = jnp.concatenate(
        [jnp.arange(num_blocks, dtype=jnp.int32) * block_m, ends - group_sizes, ends[-1:]]
    )
    cuts = jnp.sort(jnp.minimum(cuts, total))
    start, num_rows = cuts[:-1], cuts[1:] - cuts[:-1]
    expert = jnp.minimum(jnp.searchsorted(ends, start, side="right").astype(jnp.int32), num_experts - 1)
    order = jnp.argsort(num_rows == 0, stable=True)
    return expert[order], start[order], num_rows[order]


def reference_k_blocks(group_sizes, capacity, block_k):
    """`k_block_meta`'s owner of each K-block and expert order by search and sort."""
    num_experts = group_sizes.shape[0]
    hi = jnp.cumsum(group_sizes, dtype=jnp.int32)
    lo = hi - group_sizes
    blocks = jnp.where(group_sizes > 0, (hi + block_k - 1) // block_k - lo // block_k, 0)
    block_off = jnp.cumsum(blocks, dtype=jnp.int32)
    b = jnp.arange(-(-capacity // block_k) + num_experts, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(block_off, b, side="right"), 0, num_experts - 1)
    return owner, jnp.argsort(-group_sizes, stable=True).astype(jnp.int32)


@functools.cache
def programs(num_experts, capacity, block):
    """Jitted (new, reference) schedules for one shape."""
    def new(sizes, token_ids):
        sched = tile_schedule(sizes, capacity, block)
        meta = _common.tile_meta(sizes, token_ids, block)
        aligned = _common.aligned_tile_meta(sizes, capacity, block)
        kmeta = k_block_meta(sizes, token_ids, block)
        return sched, meta, aligned, kmeta

    def old(sizes):
        return (reference_tile_experts(sizes, capacity, block),
                reference_aligned_tiles(sizes, capacity, block),
                reference_k_blocks(sizes, capacity, block))

    return jax.jit(new), jax.jit(old)


@st.composite
def schedule_case(draw):
    num_experts, capacity, block = draw(st.sampled_from(SHAPES))
    kind = draw(st.sampled_from(["random", "one_expert", "empty_edges", "block_multiples"]))
    total = draw(st.integers(0, capacity))
    if kind == "one_expert":  # skew: every row in one expert
        sizes = np.zeros(num_experts, np.int64)
        sizes[draw(st.integers(0, num_experts - 1))] = total
    elif kind == "block_multiples":  # group boundaries on block boundaries, some empty
        multiples = draw(st.lists(st.integers(0, 3), min_size=num_experts, max_size=num_experts))
        sizes = np.array(multiples, np.int64) * block
        while sizes.sum() > capacity:
            sizes[np.argmax(sizes)] -= block
    else:
        cuts = np.sort(draw(st.lists(st.integers(0, total), min_size=num_experts - 1,
                                     max_size=num_experts - 1)))
        sizes = np.diff(np.concatenate([[0], cuts, [total]]))
        if kind == "empty_edges" and num_experts > 2:  # empty first and last experts
            sizes[1] += sizes[0]
            sizes[-2] += sizes[-1]
            sizes[0] = sizes[-1] = 0
    return num_experts, capacity, block, sizes.astype(np.int32)


@settings(deadline=None)  # the profile's examples (30 in CI; HYPOTHESIS_MAX_EXAMPLES for more)
@given(schedule_case())
def test_schedules_equal_the_search_and_sort_formulas(case):
    num_experts, capacity, block, sizes = case
    new, old = programs(num_experts, capacity, block)
    token_ids = jnp.arange(capacity, dtype=jnp.int32) * 7 % 101  # any ids, to gather
    sched, meta, aligned, kmeta = new(jnp.asarray(sizes), token_ids)
    (expert, row_start, row_end), (a_expert, a_start, a_rows), (owner, order) = old(jnp.asarray(sizes))

    # tile_schedule and tile_meta: every entry, padding included.
    np.testing.assert_array_equal(sched.expert, expert)
    np.testing.assert_array_equal(sched.row_start, row_start)
    np.testing.assert_array_equal(sched.row_end, row_end)
    np.testing.assert_array_equal(meta.expert, expert)
    np.testing.assert_array_equal(meta.num_rows, row_end - row_start)

    # aligned_tile_meta: the same real tiles, in the same order, then only empty ones.
    num_real = int(np.sum(np.asarray(a_rows) > 0))
    assert int(jnp.sum(aligned.num_rows > 0)) == num_real
    assert aligned.num_rows.shape == a_rows.shape
    np.testing.assert_array_equal(aligned.expert[:num_real], a_expert[:num_real])
    np.testing.assert_array_equal(aligned.row_start[:num_real], a_start[:num_real])
    np.testing.assert_array_equal(aligned.num_rows[:num_real], a_rows[:num_real])
    assert np.all(np.asarray(aligned.num_rows[num_real:]) == 0)
    assert np.all(np.asarray(aligned.row_start[num_real:]) == int(sizes.sum()))
    assert np.all((np.asarray(aligned.expert) >= 0) & (np.asarray(aligned.expert) < num_experts))

    # Each row's expert (`DispatchPlan.expert_ids`): E past the last row.
    ends = np.cumsum(sizes)
    np.testing.assert_array_equal(count_at_most(jnp.asarray(ends, jnp.int32), jnp.arange(capacity)),
                                  np.searchsorted(ends, np.arange(capacity), side="right"))

    # k_block_meta: the expert order and each K-block's rows (through its owner).
    np.testing.assert_array_equal(kmeta.order, order)
    hi = np.cumsum(sizes)
    lo = hi - sizes
    owner = np.asarray(owner)
    first_row = (lo[owner] // block + np.arange(owner.shape[0]) - np.asarray(kmeta.block_off)[owner]) * block
    rows = np.clip(first_row[:, None] + np.arange(block)[None, :], lo[owner][:, None], hi[owner][:, None] - 1)
    np.testing.assert_array_equal(kmeta.block_ids, np.asarray(token_ids)[np.clip(rows, 0, capacity - 1)])
