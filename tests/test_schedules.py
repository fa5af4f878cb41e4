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
import pytest
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


# ------------------------------------------- the forward's schedules from one Pallas program


def routing_logits(key, num_tokens, num_experts, routing="random"):
    """f32 [T, E] router logits for a routing case (also `tests/test_gpu_decode.py`'s):
    "random", "skewed" (a quarter of the experts preferred: group sizes spread ~10x),
    "empty_experts" (half the experts never chosen) or "one_expert_all_tokens" (expert 5
    in every token's top-K)."""
    logits = jax.random.normal(key, (num_tokens, num_experts), jnp.float32)
    if routing == "skewed":
        return logits + jnp.where(jnp.arange(num_experts) < num_experts // 4, 1.5, 0.0)
    if routing == "empty_experts":
        return jnp.where(jnp.arange(num_experts) < num_experts // 2, -30.0, logits)
    if routing == "one_expert_all_tokens":
        return logits.at[:, 5].add(20.0)
    assert routing == "random", routing
    return logits


def _logits_plan(key, num_tokens, num_experts, k, routing="random"):
    """A top-K plan over `routing_logits`."""
    from pallas_moe.routing import topk_plan

    return topk_plan(routing_logits(key, num_tokens, num_experts, routing), k)


def _schedule_plan(kind, key):
    from pallas_moe.routing import token_rounding_plan
    from tests.test_kernels_common import assignment_plan

    if kind.startswith("qwen3_T"):  # E = 128, K = 8 (Qwen3-30B-A3B's routing)
        return _logits_plan(key, int(kind.removeprefix("qwen3_T")), 128, 8)
    if kind in ("skewed", "empty_experts", "one_expert_all_tokens"):
        return _logits_plan(key, 64, 128, 8, routing=kind)
    if kind == "small_e":  # 6 experts, groups ending mid-tile
        return _logits_plan(key, 37, 6, 3)
    if kind == "tile_multiples":  # token rounding: every group a multiple of 64 rows, padding rows
        return token_rounding_plan(jax.random.normal(key, (100, 8)), 2, tile=64)
    if kind == "one_expert_128":  # one group of exactly 128 rows: ends on a tile boundary
        return assignment_plan(key, 128, 3, only=1)
    assert kind == "empty"  # no row at all: no real tile
    return assignment_plan(key, 9, 4, empty=range(4), extra=5)


def assert_tile_metas_bitwise_equal(got, want):
    """Every array of two `TileMeta`s, padding entries included, bit for bit."""
    assert got.block_m == want.block_m
    for name in ("expert", "row_start", "num_rows", "row_ids"):
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("plan_kind, up_rows, down_rows", [
    ("qwen3_T1", 128, 128),  # 8 one-row tiles among 128 experts
    pytest.param("qwen3_T2", 64, 128, marks=pytest.mark.slow),  # CI time: T1 and T8 cover it
    ("qwen3_T8", 128, 128),  # issue 15's case
    ("qwen3_T64", 128, 64),
    ("qwen3_T128", 128, 128),  # capacity 1024: 5 chunks of each kind
    pytest.param("skewed", 64, 64, marks=pytest.mark.slow),  # CI time: skewed-256 covers it
    ("empty_experts", 128, 128),
    ("one_expert_all_tokens", 64, 128),  # a 64-row group: whole tiles of both sizes
    ("small_e", 64, 64),
    ("tile_multiples", 64, 128),  # groups on tile boundaries, padding rows past them
    ("one_expert_128", 128, 64),
    ("empty", 64, 64),
    ("qwen3_T64", 192, 128),  # the split-M up-proj's 192-row items (tokens padded to 256)
    ("skewed", 256, 128),  # a cluster item's 256 rows (`UpProjConfig.tile_rows`)
])
def test_forward_schedule_kernel_is_bitwise_the_jnp_schedules(plan_kind, up_rows, down_rows):
    """`forward_schedule_kernel` (one Pallas program, run interpreted) gives
    `tile_meta(up_rows)` and `aligned_tile_meta(down_rows)` bit for bit, padding tiles and
    padding rows included; `forward_schedules` takes it with `schedule_impl="kernel"` in
    interpret mode."""
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.schedules import _TileMetas, forward_schedule_kernel, forward_schedules

    plan = _schedule_plan(plan_kind, jax.random.key(7))
    sizes = np.asarray(plan.group_sizes)
    if plan_kind == "one_expert_all_tokens":
        assert sizes[5] == 64
    elif plan_kind == "tile_multiples":
        assert np.all(sizes % 64 == 0) and int(plan.num_rows) < plan.capacity
    elif plan_kind == "empty":
        assert int(plan.num_rows) == 0
    want = (_common.tile_meta(plan.group_sizes, plan.token_ids, up_rows),
            _common.aligned_tile_meta(plan.group_sizes, plan.capacity, down_rows))
    got = forward_schedule_kernel(plan.group_sizes, plan.token_ids, up_rows, down_rows,
                                  interpret=True)
    for g, w in zip(got, want):
        assert_tile_metas_bitwise_equal(g, w)
    if plan_kind == "qwen3_T8":  # through the config, as `moe_forward` asks for them
        forward = ForwardConfig.for_shape(2048, 768, num_sms=4, schedule_impl="kernel")
        assert (forward.up.tile_rows, forward.down.tile_rows) == (up_rows, down_rows)
        tiles = _TileMetas(plan)
        for g, w in zip(forward_schedules(plan, forward, tiles, interpret=True), want):
            assert_tile_metas_bitwise_equal(g, w)
        assert tiles.has("rows", up_rows) and tiles.has("aligned", down_rows)


def test_schedule_impl_picks_the_kernel():
    """"kernel" runs `moe_forward_schedules` (interpreted where the kernels are), "jnp" (the
    default) the jnp formulas, "auto" the kernel up to `SCHEDULE_KERNEL_MAX_TOKENS` tokens."""
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.schedules import (
        SCHEDULE_KERNEL_MAX_TOKENS, forward_schedules, resolve_schedule_impl,
    )

    assert ForwardConfig().schedule_impl == "jnp"
    assert ForwardConfig.for_shape(2048, 768, num_sms=132).schedule_impl == "jnp"
    assert resolve_schedule_impl("kernel", 8) == "kernel"
    assert resolve_schedule_impl("kernel", 8, interpret=True) == "interpret"
    assert resolve_schedule_impl("jnp", 8, interpret=True) == "jnp"
    assert resolve_schedule_impl("auto", SCHEDULE_KERNEL_MAX_TOKENS) == "kernel"
    assert resolve_schedule_impl("auto", SCHEDULE_KERNEL_MAX_TOKENS + 1) == "jnp"
    from pallas_moe.routing import topk_plan

    plan = jax.eval_shape(lambda l: topk_plan(l, 8), jax.ShapeDtypeStruct((8, 128), jnp.float32))
    for impl, kernel in (("jnp", False), ("kernel", True), ("auto", True)):
        forward = ForwardConfig.for_shape(2048, 768, num_sms=132, schedule_impl=impl)
        text = str(jax.make_jaxpr(lambda p: forward_schedules(p, forward))(plan))
        assert ("moe_forward_schedules" in text) == kernel, impl
