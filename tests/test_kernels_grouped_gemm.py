"""The persistent grouped GEMM (`grouped_matmul`) and its two specs, the down-proj
(`Y = A @ W2[e]`) and dX~ (`dH @ W1[e]^T`, transposed weights), in Mosaic GPU interpret mode
against jnp references. Interpret mode fills fresh outputs with NaN, so an unwritten real row
fails the comparison and rows a kernel must not touch are checked to still be NaN."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels.down_proj import down_proj
from pallas_moe.kernels.dx import dx_rows
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
from pallas_moe.kernels.reference import down_proj_reference
from pallas_moe.routing import token_rounding_plan, topk_plan
from tests.test_kernels_common import (
    assert_untouched, assignment_plan, close, races_found, random_weights,
)

# 3 CTAs walk the work items (interpret mode simulates every CTA).
SPLIT_M = GroupedMatmulConfig(block_m=128, block_n=64, num_stages=3, num_sms=3)
PING_PONG_128 = GroupedMatmulConfig(block_m=128, block_n=64, num_stages=3, num_sms=3,
                                    pingpong=True)
SCHEDULES = pytest.mark.parametrize(
    "config", [SPLIT_M, PING_PONG_128], ids=["split_m", "ping_pong_128"]
)


def dx_reference(dh, group_sizes, w_gate_up):
    """dX~ = dH @ W1[e]^T per grouped row (fp32 accumulate, bf16); independent of the kernel."""
    starts = np.concatenate([[0], np.cumsum(np.asarray(group_sizes))])
    out = np.zeros((dh.shape[0], w_gate_up.shape[1]), np.float32)
    dh32, w32 = np.asarray(dh, np.float32), np.asarray(w_gate_up, np.float32)
    for e in range(w_gate_up.shape[0]):
        out[starts[e]:starts[e + 1]] = dh32[starts[e]:starts[e + 1]] @ w32[e].T
    return jnp.asarray(out).astype(jnp.bfloat16)


def run_down(plan, n, d, num_experts, config, key, interpret=True):
    ka, kw = jax.random.split(key)
    a = jax.random.normal(ka, (plan.capacity, n), jnp.float32).astype(jnp.bfloat16)
    _, w2 = random_weights(kw, num_experts, d, n)
    y = down_proj(a, plan.group_sizes, w2, config=config, interpret=interpret)
    rows = int(plan.num_rows)
    close(y, down_proj_reference(a, plan.group_sizes, w2), rows)
    assert_untouched(y, rows)
    return y


def run_dx(plan, n, d, num_experts, config, key, interpret=True):
    ka, kw = jax.random.split(key)
    dh = jax.random.normal(ka, (plan.capacity, 2 * n), jnp.float32).astype(jnp.bfloat16)
    w1, _ = random_weights(kw, num_experts, d, n)
    got = dx_rows(dh, plan.group_sizes, w1, capacity=plan.capacity, config=config,
                  interpret=interpret)
    rows = int(plan.num_rows)
    close(got, dx_reference(dh, plan.group_sizes, w1), rows)
    assert_untouched(got, rows)
    return got


@SCHEDULES
@pytest.mark.parametrize("spec", [run_down, run_dx], ids=["down_proj", "dx_rows"])
def test_no_races(spec, config):
    plan = assignment_plan(jax.random.key(30), 40, 3, p=0.5)
    spec(plan, 128, 128, 3, config, jax.random.key(31),
         interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()


@SCHEDULES
# CI time: the tile walk over ragged groups does not depend on the spec; dX~ runs raced in
# test_no_races[dx_rows-*], its ragged cases are slow extras.
@pytest.mark.parametrize("spec", [run_down, pytest.param(run_dx, marks=pytest.mark.slow)],
                         ids=["down_proj", "dx_rows"])
def test_ragged_with_empty_experts_and_padding(spec, config):
    # 3 CTAs walk 2 column blocks x the real tiles (consumers alternate items, or split
    # each 128-row tile); groups start and end anywhere inside the aligned blocks.
    plan = token_rounding_plan(jax.random.normal(jax.random.key(32), (75, 5)), 2, tile=8)
    spec(plan, 128, 128, 5, config, jax.random.key(33))


# wgmma_lag=0 is opt-in (level or slower on the H100, session 52): CI races one form per
# kernel, the other two are slow extras.
@pytest.mark.parametrize(
    "spec, config",
    [(run_down, PING_PONG_128), pytest.param(run_down, SPLIT_M, marks=pytest.mark.slow),
     pytest.param(run_dx, PING_PONG_128, marks=pytest.mark.slow), (run_dx, SPLIT_M)],
    ids=["down_proj-ping_pong", "down_proj-split_m", "dx_rows-ping_pong", "dx_rows-split_m"])
def test_wgmma_lag_0_no_races(spec, config):
    """Each slot released as soon as its own K step's wgmmas are done (`wgmma_lag=0`,
    session 51; dX~'s 4 K steps refill the ring within an item): race-free, against the
    reference, rows outside the plan untouched, and bitwise the default release."""
    plan = assignment_plan(jax.random.key(30), 40, 3, p=0.5)
    lag0 = dataclasses.replace(config, wgmma_lag=0)
    got = spec(plan, 128, 128, 3, lag0, jax.random.key(31),
               interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()
    want = spec(plan, 128, 128, 3, config, jax.random.key(31))
    rows = int(plan.num_rows)
    np.testing.assert_array_equal(np.asarray(got[:rows], np.float32),
                                  np.asarray(want[:rows], np.float32))


@pytest.mark.parametrize("config", [
    pytest.param(GroupedMatmulConfig(block_m=128, block_n=128, num_stages=3, num_sms=1,
                                     pingpong=True), id="ping_pong_128"),
    pytest.param(GroupedMatmulConfig(block_m=128, block_n=256, num_stages=2, num_sms=1),
                 id="split_m_256"),
])
@pytest.mark.parametrize("spec", [run_down, run_dx], ids=["down_proj", "dx_rows"])
def test_one_staged_output_slab_at_a_time_no_races(spec, config):
    # `out_slabs=1`: each consumer writes and stores one 64-column slab of its tile at a
    # time, waiting for the previous slab's store (2 or 4 rounds per item; one CTA walks
    # every item, so the first round's wait covers the previous item's last store).
    plan = assignment_plan(jax.random.key(34), 40, 3, p=0.5, empty=(2,))
    spec(plan, 128, 256, 3, dataclasses.replace(config, out_slabs=1), jax.random.key(35),
         interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()


def test_wide_expert_down_proj_default_no_races_and_the_ping_pongs_bits():
    """The down-proj's default from n = 768 on (session 61: split-M 128 x 256 items, 3
    stages, the whole tile staged) over a 12-step K loop on 2 CTAs, with the race detector,
    against the reference, and bit for bit the 128-row ping-pong's output (the same K loop
    per element) on a plan with an empty expert."""
    from pallas_moe.kernels.moe_forward import ForwardConfig

    wide = dataclasses.replace(ForwardConfig.for_shape(256, 768, num_sms=132).down, num_sms=2)
    assert (wide.pingpong, wide.block_m, wide.block_n, wide.num_stages) == (False, 128, 256, 3)
    plan = assignment_plan(jax.random.key(39), 40, 3, p=0.5, empty=(1,))
    got = run_down(plan, 768, 256, 3, wide, jax.random.key(40),
                   interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()
    pingpong = GroupedMatmulConfig(block_m=128, block_n=128, num_stages=5, num_sms=2,
                                   pingpong=True)
    want = run_down(plan, 768, 256, 3, pingpong, jax.random.key(40))
    rows = int(plan.num_rows)
    assert bool(jnp.array_equal(got[:rows], want[:rows]))


def test_groups_crossing_aligned_blocks_one_expert_holding_all():
    plan = assignment_plan(jax.random.key(24), 70, 3, only=1)
    run_down(plan, 64, 64, 3, SPLIT_M, jax.random.key(25))
    plan = assignment_plan(jax.random.key(22), 90, 3, p=0.7, empty=(0,))
    run_dx(plan, 64, 192, 3, GroupedMatmulConfig(block_m=128, block_n=192, num_stages=2,
                                                  num_sms=2), jax.random.key(23))


def test_single_expert_topk1_more_ctas_than_items():
    plan = topk_plan(jax.random.normal(jax.random.key(26), (24, 1)), 1)
    run_down(plan, 64, 64, 1, GroupedMatmulConfig(block_m=128, block_n=64, num_stages=2,
                                                   num_sms=5, pingpong=True), jax.random.key(27))


def test_empty_plan_writes_nothing():
    plan = token_rounding_plan(jnp.zeros((3, 2)), 1, tile=8, rounding="down")
    assert int(plan.num_rows) == 0
    a = jnp.ones((plan.capacity, 64), jnp.bfloat16)
    y = grouped_matmul(a, plan.group_sizes, jnp.ones((2, 64, 64), jnp.bfloat16),
                       transpose_w=False, config=PING_PONG_128, interpret=True)
    assert_untouched(y, 0)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: down_proj(jnp.zeros((16, 96), jnp.bfloat16), jnp.zeros((2,), jnp.int32),
                           jnp.zeros((2, 96, 64), jnp.bfloat16), config=SPLIT_M, interpret=True),
         r"a.shape\[1\]=96 must be a multiple of 64"),
        (lambda: down_proj(jnp.zeros((16, 64), jnp.bfloat16), jnp.zeros((2,), jnp.int32),
                           jnp.zeros((2, 64, 160), jnp.bfloat16), config=SPLIT_M, interpret=True),
         r"w_down.shape\[2\]=160 must be a multiple of 64"),
        (lambda: dx_rows(jnp.zeros((16, 128), jnp.bfloat16), jnp.zeros((2,), jnp.int32),
                         jnp.zeros((2, 64, 64), jnp.bfloat16), capacity=16, config=SPLIT_M,
                         interpret=True),
         r"w_gate_up.shape\[2\]=64 must equal dh.shape\[1\]=128"),
        (lambda: down_proj(jnp.zeros((16, 64), jnp.float32), jnp.zeros((2,), jnp.int32),
                           jnp.zeros((2, 64, 64), jnp.bfloat16), interpret=True),
         "a must have dtype bfloat16"),
        (lambda: GroupedMatmulConfig(block_n=320), "config.block_n=320 must be at most 256"),
        (lambda: GroupedMatmulConfig(block_m=256), "config.block_m=256 must be 128"),
        # 64-row ping-pong and 192-row three-consumer items, removed in session 64
        (lambda: GroupedMatmulConfig(block_m=64), "config.block_m=64 must be 128 .64 and 192 "
         "were removed in session 64"),
        (lambda: GroupedMatmulConfig(block_m=192), "config.block_m=192 must be 128"),
        (lambda: dx_rows(jnp.zeros((128, 128), jnp.bfloat16), jnp.zeros((2,), jnp.int32),
                         jnp.zeros((2, 256, 128), jnp.bfloat16), capacity=128,
                         config=GroupedMatmulConfig(block_n=256, num_stages=4),
                         interpret=True),
         r"config needs \d+ B of SMEM .* lower config.num_stages, or stage fewer output "
         r"columns at a time \(config.out_slabs\)"),
        (lambda: GroupedMatmulConfig(wgmma_lag=2), r"config.wgmma_lag=2 must be one of \(0, 1\)"),
        (lambda: GroupedMatmulConfig(num_sms=0), "config.num_sms=0 must be >= 1"),
        (lambda: GroupedMatmulConfig(block_n=256, pingpong=True),
         "config.pingpong keeps a 128 x block_n f32 accumulator .* block_n must be <= 128, got 256"),
        (lambda: grouped_matmul(jnp.zeros((16, 128), jnp.float8_e4m3fn), jnp.zeros((2,), jnp.int32),
                                jnp.zeros((2, 64, 128), jnp.float8_e4m3fn), transpose_w=True,
                                config=GroupedMatmulConfig(block_k=128, pingpong=True),
                                row_scales=jnp.ones((16,)), col_scales=jnp.ones((2, 64)),
                                interpret=True),
         "no registers for fp8 promotion's second set: pass fp8_promote_every=0"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.parametrize("removed", [dict(cluster_m=2), dict(out_slabs=1, out_buffers=2)],
                         ids=["cluster_m", "out_buffers"])
def test_removed_fields_are_refused(removed):
    """Fields removed in session 64 (no gain on the GPU; the module docstring says which
    patch restores each) are a TypeError, not ignored: `cluster_m` (items on clusters of two
    CTAs sharing each weight tile by multicast) and `out_buffers` (a ring of staged output
    rounds)."""
    with pytest.raises(TypeError, match=list(removed)[-1]):
        GroupedMatmulConfig(**removed)


@SCHEDULES
def test_down_proj_expert_bias_no_races(config):
    """Y = A W2[e] + b2[e]: each consumer's bias SMEM is reloaded per work item (3 CTAs walk
    several items each), bitwise the jnp reference, no races."""
    plan = assignment_plan(jax.random.key(32), 60, 4, p=0.5, empty=(2,), extra=5)
    ka, kw, kb = jax.random.split(jax.random.key(33), 3)
    a = jax.random.normal(ka, (plan.capacity, 128), jnp.float32).astype(jnp.bfloat16)
    _, w2 = random_weights(kw, 4, 128, 128)
    bias = jax.random.normal(kb, (4, 128), jnp.float32).astype(jnp.bfloat16)
    y = down_proj(a, plan.group_sizes, w2, config=config, bias=bias,
                  interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not races_found()
    rows = int(plan.num_rows)
    want = down_proj_reference(a, plan.group_sizes, w2, bias)
    np.testing.assert_array_equal(np.asarray(y[:rows], np.float32), np.asarray(want[:rows], np.float32))
    assert_untouched(y, rows)


@pytest.mark.parametrize(
    "config, num_tokens",
    [pytest.param(PING_PONG_128, 160, marks=pytest.mark.slow, id="ping_pong_128"),
     pytest.param(SPLIT_M, 160, id="split_m")],
)
def test_chunked_calls_write_the_whole_calls_rows(config, num_tokens):
    """Each call over one `TileChunks` range of the whole metadata writes exactly its rows,
    bitwise the whole down-proj's (its jnp reference, which the kernel equals bitwise), at
    rows shifted by the chunk's first row, and nothing else."""
    plan = assignment_plan(jax.random.key(34), num_tokens, 4, p=0.6, empty=(1,))
    ka, kw = jax.random.split(jax.random.key(35))
    a = jax.random.normal(ka, (plan.capacity, 64), jnp.float32).astype(jnp.bfloat16)
    _, w2 = random_weights(kw, 4, 128, 64)
    bm = config.block_m
    rows = int(plan.num_rows)
    num_chunks = 2
    chunk_rows = -(-plan.capacity // (num_chunks * bm)) * bm

    @jax.jit
    def schedule(group_sizes):
        meta = _common.aligned_tile_meta(group_sizes, plan.capacity, bm)
        bounds = _common.wave_chunk_bounds(
            meta, num_chunks, chunk_rows, items_per_tile=128 // config.block_n, wave=config.num_sms
        )
        return meta, bounds, _common.tile_chunks(meta, bounds, chunk_rows)

    meta, bounds, chunks = schedule(plan.group_sizes)
    whole = np.asarray(down_proj_reference(a, plan.group_sizes, w2), np.float32)
    row_bounds = np.asarray(bounds)
    assert 0 < row_bounds[1] < row_bounds[2] == rows  # rows really split
    for c in range(num_chunks):
        y = down_proj(a, plan.group_sizes, w2, config=config, meta=meta, chunks=chunks, chunk=c,
                      interpret=True)
        assert y.shape == (chunk_rows, 128)
        lo, hi = row_bounds[c], row_bounds[c + 1]
        np.testing.assert_array_equal(np.asarray(y[: hi - lo], np.float32), whole[lo:hi])
        assert_untouched(y, hi - lo)


@pytest.mark.parametrize("device_kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"], ids=["h100", "h200"])
@pytest.mark.parametrize("d, n, bias", [(1536, 256, True), (4096, 512, False), (2048, 768, True)],
                         ids=["7b", "30b", "qwen3"])
def test_default_schedules_lower_for_cuda(d, n, bias, device_kind):
    """The default down-proj and dX~ configs of each card lower for cuda at production
    widths, the down-proj with its expert bias (interpret mode does not model the SMEM
    budget; the GPU runs them in benchmarks/ and test_gpu.py). The 128-row ping-pong: on an
    H100 5 stages beside the whole output tiles (224 KB); on an H200 one 64-column slab
    staged at a time (the down-proj 5 stages, dX~ the 6th that frees; session 37). From
    n = 768 on the down-proj runs split-M items 256 columns wide (session 61)."""
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig

    E, P = 16, 4096 * 8
    down_cfg = ForwardConfig.for_shape(d, n, device_kind=device_kind).down
    dx_cfg = BackwardConfig.for_shape(d, n, device_kind=device_kind).dx
    assert down_cfg.pingpong == (n <= 512) and dx_cfg.pingpong == (n <= 256)
    h200 = device_kind == "NVIDIA H200"
    if down_cfg.pingpong:
        assert (down_cfg.num_stages, down_cfg.out_slabs) == (5, int(h200))
    else:
        assert (down_cfg.block_m, down_cfg.block_n, down_cfg.num_stages) == (128, 256, 3)
    if dx_cfg.pingpong:
        assert (dx_cfg.num_stages, dx_cfg.out_slabs) == ((6, 1) if h200 else (5, 0))
    else:  # split M, 256 columns: one slab measured slower (0.89x at 30B)
        assert (dx_cfg.num_stages, dx_cfg.out_slabs, dx_cfg.block_n) == (3, 0, 256)
    _lower_down_and_dx_for_cuda(d, n, E, P, down_cfg, dx_cfg, bias=bias)


@pytest.mark.parametrize("device_kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"], ids=["h100", "h200"])
def test_down_proj_takes_split_m_items_where_its_k_loop_is_long(device_kind):
    """The down-proj's K is n: the 128-row ping-pong (its epilogue under the other
    consumer's wgmmas) up to n = 512, split-M items 128 x 256 (3 stages) from
    `SPLIT_M_DOWN_MIN_N` = 768 on where 256 divides d (session 61 on the H100: 1.05-1.25x at
    n = 768 to 2048, 0.96-0.97x at n = 512), the widest block that divides d elsewhere."""
    from pallas_moe.kernels.moe_forward import PINGPONG_DOWN, SPLIT_M_DOWN_MIN_N, ForwardConfig

    assert SPLIT_M_DOWN_MIN_N == 768
    for d, n, want in [(1536, 256, "pingpong"), (4096, 512, "pingpong"), (1536, 512, "pingpong"),
                       (2048, 768, "split"), (1536, 1024, "split"), (4096, 1024, "split"),
                       (4096, 2048, "split"), (7168, 2048, "split"), (1152, 1024, "pingpong"),
                       (2880, 2880, 192)]:
        down = ForwardConfig.for_shape(d, n, num_sms=132, device_kind=device_kind).down
        if want == "pingpong":
            assert down.pingpong and down.block_n == PINGPONG_DOWN.block_n, (d, n, down)
        elif want == "split":
            assert not down.pingpong, (d, n, down)
            assert (down.block_m, down.block_n, down.num_stages, down.num_sms) == (
                128, 256, 3, 132), (d, n, down)
        else:
            assert not down.pingpong and down.block_n == want, (d, n, down)


def _lower_down_and_dx_for_cuda(d, n, num_experts, rows, down_cfg, dx_cfg, bias=True):
    """Lowers the down-proj (with an expert bias unless `bias=False`) under `down_cfg` and
    dX~ under `dx_cfg` for cuda (an H100 target) at widths (d, n), `num_experts` experts
    and `rows` rows."""
    from tests.cuda_target import h100_target

    E, P = num_experts, rows
    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    down_f = jax.jit(lambda a, g, w, b: down_proj(a, g, w, config=down_cfg, bias=b))
    dx_f = jax.jit(lambda h, g, w: dx_rows(h, g, w, capacity=P, config=dx_cfg))
    with h100_target():
        down_f.trace(sds((P, n), bf16), sds((E,), i32), sds((E, n, d), bf16),
                     sds((E, d), bf16) if bias else None).lower(lowering_platforms=("cuda",))
        dx_f.trace(sds((P, 2 * n), bf16), sds((E,), i32),
                   sds((E, d, 2 * n), bf16)).lower(lowering_platforms=("cuda",))


# CI time: the 7B widths run the same sweep builders and SMEM arithmetic; 30B's sweep configs
# lower again on the GPU whenever the sweep runs.
@pytest.mark.parametrize("d, n", [(1536, 256), pytest.param(4096, 512, marks=pytest.mark.slow)],
                         ids=["7b", "30b"])
def test_one_staged_slab_frees_a_stage_at_production_widths(d, n):
    """The `out_slabs` configs the benchmarks sweep (`forward.py --down-sweep slabs`,
    `backward.py --sweep slabs`) lower for cuda: one more stage than the whole-tile default
    fits in SMEM only with fewer output slabs staged at a time (Mosaic refuses the same
    stages beside the whole tile)."""
    from benchmarks.backward import configs_for
    from benchmarks.forward import staged_down_cfgs
    from tests.cuda_target import h100_target

    E, P = 16, 4096 * 8
    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    down_cfgs = staged_down_cfgs(d, n)
    dx_cfgs = configs_for(d, n, "slabs")[-1]
    assert len(down_cfgs) == 3 and len(dx_cfgs) == (3 if n <= 256 else 4)
    operands = dict(
        down=(sds((P, n), bf16), sds((E,), i32), sds((E, n, d), bf16)),
        dx=(sds((P, 2 * n), bf16), sds((E,), i32), sds((E, d, 2 * n), bf16)),
    )

    def lower(kind, config):
        f = (functools.partial(down_proj, config=config) if kind == "down"
             else functools.partial(dx_rows, capacity=P, config=config))
        with h100_target():
            jax.jit(f).trace(*operands[kind]).lower(lowering_platforms=("cuda",))

    for kind, cfgs in (("down", down_cfgs), ("dx", dx_cfgs)):
        default, deeper = cfgs[0], cfgs[2]  # on a CPU host the whole tile is the default
        assert default.out_slabs == 0
        assert deeper.num_stages == default.num_stages + 1 and deeper.out_slabs == 1
        for config in cfgs:
            lower(kind, config)
        with pytest.raises(ValueError, match=r"config needs \d+ B of SMEM .* over the 232448 B"):
            lower(kind, dataclasses.replace(deeper, out_slabs=0))


@pytest.mark.parametrize("kind, d, n, config", [
    ("dx", 4096, 512, GroupedMatmulConfig(block_m=128, block_n=256, num_stages=4)),
    ("down", 1536, 256, GroupedMatmulConfig(block_m=128, block_n=128, num_stages=6,
                                            pingpong=True)),
    ("down_bias", 2880, 2880, GroupedMatmulConfig(block_m=128, block_n=192, num_stages=5)),
], ids=["dx_256_cols_4_stages", "down_pingpong_6_stages", "down_bias_192_cols_5_stages"])
def test_smem_count_is_what_mosaic_counts(monkeypatch, kind, d, n, config):
    """`grouped_gemm.smem_bytes` counts the SMEM Mosaic GPU counts, byte for byte: with the
    refusal above `_common.SMEM_MAX` lifted, Mosaic refuses these configs itself and names
    its count (session 51: the since removed 192-row items of 30B's dX~ took 270384 B, which
    only Mosaic refused, deep in the compile). So the config check refuses exactly what
    Mosaic would."""
    import re

    from pallas_moe.kernels.grouped_gemm import smem_bytes
    from tests.cuda_target import h100_target

    E, P = 16, 4096
    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    bias = kind == "down_bias"
    if kind == "dx":
        f = functools.partial(dx_rows, capacity=P, config=config)
        operands = (sds((P, 2 * n), bf16), sds((E,), i32), sds((E, d, 2 * n), bf16))
    else:
        def f(a, group_sizes, w2, b2):
            return down_proj(a, group_sizes, w2, config=config, bias=b2)
        operands = (sds((P, n), bf16), sds((E,), i32), sds((E, n, d), bf16),
                    sds((E, d), bf16) if bias else None)
    counted = smem_bytes(config, d, in_dtype=bf16, out_dtype=bf16, has_bias=bias)
    assert counted > _common.SMEM_MAX
    with h100_target(), pytest.raises(ValueError, match=f"config needs {counted} B of SMEM"):
        jax.jit(f).trace(*operands).lower(lowering_platforms=("cuda",))
    monkeypatch.setattr(_common, "SMEM_MAX", 1 << 30)
    with h100_target(), pytest.raises(ValueError, match="exceeds available shared memory") as e:
        jax.jit(f).trace(*operands).lower(lowering_platforms=("cuda",))
    assert int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1)) == counted
