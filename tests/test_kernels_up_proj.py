"""Up-proj kernel (gathered grouped GEMM + SwiGLU) in Mosaic GPU interpret mode vs jnp."""

from __future__ import annotations

import dataclasses

import pytest

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels.reference import up_proj_reference
from pallas_moe.kernels.up_proj import UpProjConfig, interleave_gate_up, up_proj
from pallas_moe.ops.activation import SwiGLU
from pallas_moe.routing import token_rounding_plan, topk_plan
from tests.test_kernels_common import (
    assert_untouched, assignment_plan, close, races_found, random_weights, random_x,
)

# One consumer warpgroup beside the producer (the smallest kernel; 64-column blocks).
WS1 = UpProjConfig(block_m=64, block_n=64, num_stages=2, num_consumers=1)
# The warp-specialized kernel the forward uses on H100 (2 consumers share each A stage).
WS = UpProjConfig(block_m=64, block_n=64, num_stages=2, num_consumers=2)
# Persistent split-M: two CTAs walk 128-row items, both consumers take every item (64 rows
# each) and share its weight tiles.
SPLIT_M = UpProjConfig(block_m=128, block_n=64, num_stages=2, num_consumers=2,
                          pingpong_ctas=2)


def run_and_check(x, plan, w1, config, interpret=True):
    h, a = up_proj(x, plan.token_ids, plan.group_sizes, w1, config=config, interpret=interpret)
    h_ref, a_ref = up_proj_reference(x, plan.token_ids, plan.group_sizes, w1)
    rows = int(plan.num_rows)
    close(h, h_ref, rows)
    close(a, a_ref, rows)
    assert_untouched(h, rows)  # padding rows are never written
    assert_untouched(a, rows)
    return h, a


# CI time (opt-in extras): test_expert_bias_and_clamped_swiglu_no_races runs the same kernel
# with ragged groups, an empty expert and padding rows, raced and bitwise its reference.
@pytest.mark.slow
@pytest.mark.parametrize("config", [WS1, WS], ids=["one_consumer", "two_consumers"])
def test_ragged_groups_with_empty_expert(config):
    ks = jax.random.split(jax.random.key(10), 3)
    x = random_x(ks[0], 40, 128)
    w1, _ = random_weights(ks[1], 4, 128, 128)
    plan = assignment_plan(ks[2], 40, 4, empty=(1,), extra=5)  # groups end inside tiles
    run_and_check(x, plan, w1, config)


# CI time (an opt-in extra): test_persistent_split_m_equals_cooperative_no_races[halves] has items
# ending in either half, raced and bitwise the cooperative kernel
@pytest.mark.slow
def test_split_m_tiles_ending_in_either_half():
    # 150 rows over 2 experts with 128-row tiles: tiles end in the first and second 64-row
    # half, so each consumer stores 0..64 rows.
    ks = jax.random.split(jax.random.key(16), 3)
    x = random_x(ks[0], 150, 128)
    w1, _ = random_weights(ks[1], 2, 128, 64)
    plan = assignment_plan(ks[2], 150, 2, p=0.6)
    run_and_check(x, plan, w1, SPLIT_M)


def test_one_expert_holds_all_tokens_multi_tile():
    ks = jax.random.split(jax.random.key(11), 3)
    x = random_x(ks[0], 70, 64)  # 70 rows -> two tiles of one expert, the second ragged
    w1, _ = random_weights(ks[1], 3, 64, 64)
    plan = assignment_plan(ks[2], 70, 3, only=2)
    run_and_check(x, plan, w1, WS1)


def test_single_expert_topk1():
    ks = jax.random.split(jax.random.key(12), 4)
    x = random_x(ks[0], 24, 64)
    w1, _ = random_weights(ks[1], 1, 64, 64)
    plan = topk_plan(jax.random.normal(ks[2], (24, 1)), 1)  # E = 1, K = 1
    run_and_check(x, plan, w1, WS1)


# CI time (an opt-in extra): padding rows are in the bias and ragged tests (extra rows), a token-
# rounding plan through the up-proj in test_numerics' mode-sum test
@pytest.mark.slow
def test_token_rounding_plan_with_padding_rows():
    ks = jax.random.split(jax.random.key(13), 4)
    x = random_x(ks[0], 48, 64)
    w1, _ = random_weights(ks[1], 4, 64, 128)
    plan = token_rounding_plan(jax.random.normal(ks[2], (48, 4)), 2, tile=8)
    assert int(plan.num_rows) < plan.capacity
    run_and_check(x, plan, w1, UpProjConfig(block_m=64, block_n=64, num_stages=3, num_consumers=2))


# CI time (an opt-in extra): test_moe_ffn_kernels' undifferentiated-call test runs the inference up-
# proj through the op, bitwise the training output
@pytest.mark.slow
def test_inference_writes_only_a():
    ks = jax.random.split(jax.random.key(14), 3)
    x = random_x(ks[0], 30, 64)
    w1, _ = random_weights(ks[1], 3, 64, 128)
    plan = assignment_plan(ks[2], 30, 3)
    h, a = up_proj(x, plan.token_ids, plan.group_sizes, w1, config=WS, inference=True,
                   interpret=True)
    assert h is None
    _, a_ref = up_proj_reference(x, plan.token_ids, plan.group_sizes, w1)
    close(a, a_ref, int(plan.num_rows))


# Split-M's race test: test_persistent_split_m_equals_cooperative_no_races. CI time: two
# consumers run raced in test_expert_bias_and_clamped_swiglu_no_races[two_consumers].
@pytest.mark.parametrize(
    "config", [WS1, pytest.param(WS, marks=pytest.mark.slow)],
    ids=["one_consumer", "two_consumers"])
def test_no_races(config):
    ks = jax.random.split(jax.random.key(15), 3)
    x = random_x(ks[0], 20, 256)  # 4 K steps > 2 stages: slots are refilled
    w1, _ = random_weights(ks[1], 2, 256, 128)
    plan = assignment_plan(ks[2], 20, 2, p=0.6)
    run_and_check(x, plan, w1, config, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()


@pytest.mark.parametrize(
    "shape, config, match",
    [
        ((64, 96, 2, 64), WS1, "d \\(x.shape\\[1\\]\\)=96 must be a multiple of 64"),
        ((64, 64, 2, 96), WS1, "n \\(w_gate_up.shape\\[2\\] // 2\\)=96 must be a multiple of 64"),
        ((64, 64, 2, 64), WS, "n \\(w_gate_up.shape\\[2\\] // 2\\)=64 must be a multiple of 128"),
        ((64, 64, 2, 64), UpProjConfig(block_k=128), "config.block_k=128 must be 64"),
        ((64, 64, 2, 64), UpProjConfig(block_m=32), "config.block_m=32 must be a multiple of 64"),
        ((64, 64, 2, 64), UpProjConfig(block_n=64, num_consumers=0),
         "config.num_consumers=0 must be >= 1"),
    ],
)
def test_bad_dims_raise_naming_the_argument(shape, config, match):
    t, d, e, n = shape
    x = jnp.zeros((t, d), jnp.bfloat16)
    w1 = jnp.zeros((e, d, 2 * n), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        up_proj(x, jnp.zeros((t,), jnp.int32), jnp.zeros((e,), jnp.int32), w1, config=config,
                interpret=True)


def test_bad_dtype_and_shape_raise():
    x = jnp.zeros((8, 64), jnp.float32)
    w1 = jnp.zeros((2, 64, 128), jnp.bfloat16)
    with pytest.raises(TypeError, match="x must have dtype bfloat16"):
        up_proj(x, jnp.zeros((8,), jnp.int32), jnp.zeros((2,), jnp.int32), w1, interpret=True)
    with pytest.raises(ValueError, match="w_gate_up.shape\\[1\\]=64 must equal x.shape\\[1\\]=128"):
        up_proj(jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((8,), jnp.int32),
                jnp.zeros((2,), jnp.int32), w1, interpret=True)


CLAMPED = SwiGLU.clamped(alpha=1.702, limit=0.75)  # small limit: both clamps are hit


@pytest.mark.parametrize(
    # CI time: the bias copy and its reads race-checked with two consumers; one consumer's
    # pipeline without them in test_no_races[one_consumer].
    "config", [pytest.param(WS1, marks=pytest.mark.slow), WS], ids=["one_consumer", "two_consumers"])
def test_expert_bias_and_clamped_swiglu_no_races(config):
    """H = X W1 + b1 (bias added before rounding), A = clamped SwiGLU of H: bitwise the jnp
    reference, every tile's bias columns, no races between the bias copy and its reads."""
    ks = jax.random.split(jax.random.key(17), 4)
    x = random_x(ks[0], 20, 256)  # 4 K steps > 2 stages
    w1, _ = random_weights(ks[1], 3, 256, 128)
    bias = (0.5 * jax.random.normal(ks[3], (3, 256))).astype(jnp.bfloat16)
    plan = assignment_plan(ks[2], 20, 3, p=0.6, empty=(1,), extra=3)
    h, a = up_proj(x, plan.token_ids, plan.group_sizes, w1, config=config, bias=bias,
                   activation=CLAMPED, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()
    h_ref, a_ref = up_proj_reference(x, plan.token_ids, plan.group_sizes, w1, bias, CLAMPED)
    rows = int(plan.num_rows)
    hg = np.asarray(h_ref[:rows], np.float32)
    assert np.mean(hg[:, :128] > 0.75) > 0.1 and np.mean(np.abs(hg[:, 128:]) > 0.75) > 0.2
    np.testing.assert_array_equal(np.asarray(h[:rows], np.float32), hg)
    np.testing.assert_array_equal(np.asarray(a[:rows], np.float32), np.asarray(a_ref[:rows], np.float32))
    assert_untouched(h, rows)
    assert_untouched(a, rows)


def test_bias_of_the_wrong_shape_raises():
    x = jnp.zeros((8, 64), jnp.bfloat16)
    w1 = jnp.zeros((2, 64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="bias must have shape \\(2, 128\\)"):
        up_proj(x, jnp.zeros((8,), jnp.int32), jnp.zeros((2,), jnp.int32), w1,
                bias=jnp.zeros((2, 64), jnp.bfloat16), config=WS1, interpret=True)


# CI time (an opt-in extra): test_pingpong_equals_cooperative_no_races[two_slabs_idle_ctas]
# raced two slabs per tile (block_n=128)
@pytest.mark.slow
def test_two_swizzled_slabs_per_consumer_no_races():
    """block_n=128: each consumer's A and H tiles span two swizzled 64-column slabs
    (`_common.row_tile_types`); ragged groups and an empty expert; race-free, equal to the
    reference, padding rows untouched (`run_and_check`)."""
    ks = jax.random.split(jax.random.key(17), 3)
    x = random_x(ks[0], 40, 128)
    w1, _ = random_weights(ks[1], 3, 128, 256)
    plan = assignment_plan(ks[2], 40, 3, empty=(1,), extra=5)
    config = UpProjConfig(block_m=64, block_n=128, num_stages=2, num_consumers=2)
    run_and_check(x, plan, w1, config, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()


# The ping-pong kernel: persistent CTAs whose two consumers take alternate items.
PINGPONG = UpProjConfig(block_m=64, block_n=64, num_stages=2, num_consumers=2, pingpong_ctas=3)


@pytest.mark.parametrize(
    "config, inference",
    [pytest.param(PINGPONG, False, marks=pytest.mark.slow),  # CI: the default form below
     # Two slabs per item (the one-tile epilogue buffer: a store wait before every tile),
     # more CTAs than items: some CTAs and consumers have no work.
     (dataclasses.replace(PINGPONG, block_n=128, num_stages=3, pingpong_ctas=8), False),
     pytest.param(PINGPONG, True, marks=pytest.mark.slow),
     # One wgmma of N = 2 * block_n on a [bk, gate | up] weight tile per K step, one box of
     # W1 interleaved per block_n (the only layout it reads).
     pytest.param(dataclasses.replace(PINGPONG, fused_gate_up=True), False,
                  marks=pytest.mark.slow),
     # Each slot released as soon as its own step's wgmmas are done (`wgmma_lag=0`): with 2
     # stages one loads while the other is multiplied (with the default lag none would).
     (dataclasses.replace(PINGPONG, wgmma_lag=0), False)],
    ids=["three_ctas", "two_slabs_idle_ctas", "inference", "fused_gate_up",
         "wgmma_lag_0"],
)
def test_pingpong_equals_cooperative_no_races(config, inference):
    """Bit for bit the cooperative kernel (same wgmmas per consumer, same epilogue), with an
    expert bias and the clamped SwiGLU, ragged groups and an empty expert; race-free;
    padding rows untouched. The fused form reads W1 interleaved per block_n."""
    ks = jax.random.split(jax.random.key(18), 4)
    x = random_x(ks[0], 40, 256)  # 4 K steps > the stages: slots are refilled across items
    w1, _ = random_weights(ks[1], 3, 256, 256)
    bias = (0.5 * jax.random.normal(ks[3], (3, 512))).astype(jnp.bfloat16)
    plan = assignment_plan(ks[2], 40, 3, empty=(1,), extra=5)
    args = (x, plan.token_ids, plan.group_sizes, w1)
    kw = dict(bias=bias, activation=CLAMPED)
    coop = UpProjConfig(block_m=64, block_n=64, num_stages=2, num_consumers=2)
    want_h, want_a = up_proj(*args, config=coop, interpret=True, **kw)
    blocks = config.block_n if config.fused_gate_up else 0  # fused: interleaved W1 only
    w = interleave_gate_up(w1, blocks) if blocks else w1
    h, a = up_proj(*args[:3], w, config=config, inference=inference, **kw,
                   gate_up_blocks=blocks, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()
    rows = int(plan.num_rows)
    np.testing.assert_array_equal(np.asarray(a[:rows], np.float32),
                                  np.asarray(want_a[:rows], np.float32))
    assert_untouched(a, rows)
    if inference:
        assert h is None
    else:
        np.testing.assert_array_equal(np.asarray(h[:rows], np.float32),
                                      np.asarray(want_h[:rows], np.float32))
        assert_untouched(h, rows)
    _, a_ref = up_proj_reference(x, plan.token_ids, plan.group_sizes, w1, bias, CLAMPED)
    close(a, a_ref, rows)


@pytest.mark.parametrize(
    "fused, block_m, cluster_m, wgmma_lag",
    [(False, 128, 1, 1), pytest.param(True, 128, 1, 1, marks=pytest.mark.slow),
     (False, 192, 1, 1), (False, 128, 2, 1), pytest.param(False, 192, 2, 1, marks=pytest.mark.slow),
     pytest.param(False, 128, 2, 0, marks=pytest.mark.slow)],
    # CI: the halves layout; fused differs only in the weight tiles it reads. wgmma_lag=0
    # is opt-in (level on the H100, session 52; its GPU test passed): CI races it in the
    # ping-pong (test_pingpong_equals_cooperative_no_races[wgmma_lag_0])
    ids=["halves", "fused_interleaved", "three_consumers", "clusters",
         "three_consumers_clusters", "clusters_wgmma_lag_0"])
def test_persistent_split_m_equals_cooperative_no_races(fused, block_m, cluster_m, wgmma_lag):
    """Persistent split-M tiles (`pingpong_ctas` with block_m=128: both consumers take every
    128-row item, 64 rows each; two N = block_n wgmmas on W1's halves, or one N = 2 * block_n
    on interleaved W1; block_m=192: three consumers) give bit for bit the cooperative
    kernel's H and A, race-free, with an expert bias and the clamped
    SwiGLU. Groups of 136, 0, 142 and 124 rows: full items, items whose last consumer has
    no rows (8 and 14 rows), one whose second consumer has 60 (with 192-row items: items of
    136 and 142 rows whose third consumer has 8 and 14, one of 124 whose third has none), an
    empty expert; 2 CTAs walk the items on a 3-slot ring (2 K steps per item, so slots
    refill across items).

    `cluster_m=2`: the items on 2 clusters of two CTAs, which take two consecutive row
    blocks of one expert and share each weight tile through a cluster multicast copy (a
    slot refilled once the consumers of both CTAs released it); with 128-row blocks the
    cluster items of 256 rows give the second CTA 8, 14 or no rows, so a CTA runs items it
    stores nothing of. Interpret mode has no multicast (each CTA loads the whole tile), so
    this checks the cluster protocol and the row split: a wrong arrival count on the
    cluster barrier hangs or races here.

    `wgmma_lag=0`: each consumer releases a slot once its own step's wgmmas are done (on a
    cluster, the slot refills once all four consumers did)."""
    ks = jax.random.split(jax.random.key(0), 4)
    x = random_x(ks[1], 300, 128)
    w1, _ = random_weights(ks[2], 4, 128, 128)  # n = 128: two 64-column blocks
    bias = (0.5 * jax.random.normal(ks[3], (4, 256))).astype(jnp.bfloat16)
    plan = assignment_plan(jax.random.key(0), 300, 4, p=0.42, empty=(1,), extra=5)
    assert plan.group_sizes.tolist() == [136, 0, 142, 124]
    args = (x, plan.token_ids, plan.group_sizes)
    kw = dict(bias=bias, activation=CLAMPED)
    coop = UpProjConfig(block_m=64, block_n=64, num_stages=2, num_consumers=2)
    want_h, want_a = up_proj(*args, w1, config=coop, interpret=True, **kw)
    config = UpProjConfig(block_m=block_m, block_n=64, num_stages=3,
                          num_consumers=block_m // 64, pingpong_ctas=2 * cluster_m,
                          fused_gate_up=fused, cluster_m=cluster_m, wgmma_lag=wgmma_lag)
    assert config.tile_rows == cluster_m * block_m
    h, a = up_proj(*args, interleave_gate_up(w1, 64) if fused else w1, config=config,
                   gate_up_blocks=64 if fused else 0, **kw,
                   interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()
    rows = int(plan.num_rows)
    assert_same_rows(h, a, want_h, want_a, rows)
    assert_untouched(h, rows)


@pytest.mark.parametrize(
    "kernel, fused",
    # CI: the fused ping-pong form (interleaved W1, the only layout the fused forms read); the
    # two-wgmma forms with interleaved W1 differ only in the weight copies' column offsets.
    # The fused split-M form (opt-in, not a default) is a slow extra: [pingpong-True] runs
    # the same interleaved copies and N = 2 * block_n wgmma, and
    # test_persistent_split_m_equals_cooperative_no_races[halves] the split-M walk (CI time).
    # Since session 46 [pingpong-True] is a slow extra too: `fused_gate_up` is opt-in, and
    # its ping-pong and split-M forms lower for cuda in CI.
    [pytest.param("pingpong", False, marks=pytest.mark.slow),
     pytest.param("pingpong", True, marks=pytest.mark.slow),
     pytest.param("split_m", False, marks=pytest.mark.slow),
     pytest.param("split_m", True, marks=pytest.mark.slow)],
)
def test_interleaved_weights_equal_halves(kernel, fused):
    """W1 with gate and up columns interleaved per block_n (`gate_up_blocks`, one weight TMA
    and one N = 2 * block_n wgmma per K step when fused) gives bit for bit the cooperative
    kernel's H and A on the halves layout, in the ping-pong kernel and with split-M tiles;
    race-free."""
    ks = jax.random.split(jax.random.key(23), 4)
    x = random_x(ks[0], 40, 256)
    w1, _ = random_weights(ks[1], 3, 256, 128)  # n = 128: two 64-column blocks
    bias = (0.5 * jax.random.normal(ks[3], (3, 256))).astype(jnp.bfloat16)
    plan = assignment_plan(ks[2], 40, 3, empty=(1,), extra=5)
    args = (x, plan.token_ids, plan.group_sizes)
    coop = UpProjConfig(block_m=64, block_n=64, num_stages=2, num_consumers=2)
    want_h, want_a = up_proj(*args, w1, config=coop, bias=bias, interpret=True)
    config = dataclasses.replace(PINGPONG if kernel == "pingpong" else SPLIT_M,
                                 fused_gate_up=fused)
    h, a = up_proj(*args, interleave_gate_up(w1, 64), config=config, bias=bias,
                   gate_up_blocks=64, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()
    assert_same_rows(h, a, want_h, want_a, int(plan.num_rows))


def assert_same_rows(h, a, want_h, want_a, rows):
    """H and A bit for bit the wanted ones over the plan's rows; A's padding untouched."""
    np.testing.assert_array_equal(np.asarray(h[:rows], np.float32),
                                  np.asarray(want_h[:rows], np.float32))
    np.testing.assert_array_equal(np.asarray(a[:rows], np.float32),
                                  np.asarray(want_a[:rows], np.float32))
    assert_untouched(a, rows)


def test_interleave_gate_up_layout():
    w = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)  # n = 4
    got = interleave_gate_up(w, 2)
    np.testing.assert_array_equal(got[..., :2], w[..., :2])  # gate block 0
    np.testing.assert_array_equal(got[..., 2:4], w[..., 4:6])  # its up block
    np.testing.assert_array_equal(got[..., 4:6], w[..., 2:4])  # gate block 1
    np.testing.assert_array_equal(got[..., 6:], w[..., 6:])  # its up block
    with pytest.raises(ValueError, match="must be a multiple of 3"):
        interleave_gate_up(w, 3)


@pytest.mark.parametrize(
    "config, blocks, match",
    [(PINGPONG, 128, "gate_up_blocks=128 .* needs the persistent kernel .* "
      "gate_up_blocks == config.block_n=64"),
     (WS, 64, "gate_up_blocks=64 .* needs the persistent kernel")],
)
def test_gate_up_blocks_needs_a_kernel_that_reads_them(config, blocks, match):
    x = jnp.zeros((16, 64), jnp.bfloat16)
    w1 = jnp.zeros((2, 64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        up_proj(x, jnp.zeros((16,), jnp.int32), jnp.zeros((2,), jnp.int32), w1, config=config,
                gate_up_blocks=blocks, interpret=True)


@pytest.mark.parametrize("config", [PINGPONG, SPLIT_M], ids=["pingpong", "split_m"])
def test_fused_gate_up_needs_interleaved_weights(config):
    """`fused_gate_up` reads W1 interleaved per block_n only: W1's halves layout
    (gate_up_blocks=0) is rejected, naming the fix."""
    x = jnp.zeros((16, 64), jnp.bfloat16)
    w1 = jnp.zeros((2, 64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=(
            r"config.fused_gate_up=True reads W1 interleaved per block_n, got "
            r"gate_up_blocks=0 \(the halves layout\): interleave it with "
            r"interleave_gate_up\(w, 64\) and pass gate_up_blocks=64")):
        up_proj(x, jnp.zeros((16,), jnp.int32), jnp.zeros((2,), jnp.int32), w1,
                config=dataclasses.replace(config, fused_gate_up=True), interpret=True)


@pytest.mark.parametrize(
    "config, match",
    [
        (dataclasses.replace(PINGPONG, num_consumers=1),
         "needs block_m=64 with num_consumers=2"),
        (dataclasses.replace(PINGPONG, block_m=192), "block_m=128 or 192 with num_consumers = "
         "block_m // 64 \\(split-M\\), got num_consumers=2, block_m=192"),
        (dataclasses.replace(PINGPONG, block_m=256, num_consumers=4),
         "block_m=128 or 192 .* got num_consumers=4, block_m=256"),
        (dataclasses.replace(SPLIT_M, cluster_m=3), "config.cluster_m=3 must be 1 or 2"),
        (dataclasses.replace(SPLIT_M, wgmma_lag=2), r"config.wgmma_lag=2 must be one of \(0, 1\)"),
        (dataclasses.replace(PINGPONG, cluster_m=2), "cluster_m=2 .* needs the persistent "
         "split-M kernel with an even CTA count.*got block_m=64, pingpong_ctas="),
        (dataclasses.replace(SPLIT_M, pingpong_ctas=3, cluster_m=2),
         "got block_m=128, pingpong_ctas=3"),
        (UpProjConfig(block_m=64, block_n=64, num_consumers=2, cluster_m=2),
         "cluster_m=2 .* needs the persistent split-M kernel"),
        # One CTA per tile is 64-row tiles only: split-M items are the persistent kernel's.
        (UpProjConfig(block_m=128, block_n=64, num_consumers=2),
         "block_m=128 needs the persistent kernel.*set pingpong_ctas > 0"),
        (dataclasses.replace(PINGPONG, pingpong_ctas=-1), "pingpong_ctas=-1 must be >= 0"),
        (UpProjConfig(block_n=64, num_consumers=2, fused_gate_up=True),
         "fused_gate_up=True needs the persistent kernel"),
        (dataclasses.replace(PINGPONG, block_n=256, fused_gate_up=True),
         "needs 2 \\* block_n <= 256 .* got block_n=256"),
        (dataclasses.replace(SPLIT_M, block_n=256, fused_gate_up=True),
         "needs 2 \\* block_n <= 256 .* got block_n=256"),
        (dataclasses.replace(PINGPONG, block_n=128, num_stages=6),
         "needs \\d+ B of SMEM .* lower config.num_stages"),
    ],
)
def test_pingpong_bad_config_raises(config, match):
    x = jnp.zeros((16, 64), jnp.bfloat16)
    w1 = jnp.zeros((2, 64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        up_proj(x, jnp.zeros((16,), jnp.int32), jnp.zeros((2,), jnp.int32), w1, config=config,
                interpret=True)


def test_removed_epilogue_tiles_is_refused():
    """`UpProjConfig.epilogue_tiles` (several staged epilogue tiles per consumer, slower on
    the H100 and an H200) was removed in session 63: a config naming it fails loudly."""
    with pytest.raises(TypeError, match="epilogue_tiles"):
        UpProjConfig(block_n=64, num_consumers=2, epilogue_tiles=3)


def test_pingpong_plan_without_rows_writes_nothing():
    """A plan that routed no row (every group empty): no CTA has an item, every barrier
    is left balanced (interpret mode checks it), and no output row is written."""
    ks = jax.random.split(jax.random.key(19), 3)
    x = random_x(ks[0], 12, 128)
    w1, _ = random_weights(ks[1], 3, 128, 128)
    plan = assignment_plan(ks[2], 12, 3, empty=(0, 1, 2), extra=7)
    assert int(plan.num_rows) == 0
    h, a = up_proj(x, plan.token_ids, plan.group_sizes, w1,
                   config=dataclasses.replace(PINGPONG, block_n=128, num_stages=3),
                   interpret=True)
    assert_untouched(h, 0)
    assert_untouched(a, 0)
