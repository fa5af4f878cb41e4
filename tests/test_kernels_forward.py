"""Forward entry point (up -> down -> aggregate) in interpret mode, and lowering-only checks
of every kernel at production block sizes and shapes (no GPU needed)."""

from __future__ import annotations

import dataclasses

import pytest

import jax
import jax.numpy as jnp

from pallas_moe.kernels.aggregate import aggregate
from pallas_moe.kernels.down_proj import down_proj
from pallas_moe.kernels.moe_forward import (
    CLUSTER_UP_MIN_D, ForwardConfig, moe_forward, split_m_up_config,
)
from pallas_moe.kernels.reference import moe_forward_reference
from pallas_moe.kernels.up_proj import UpProjConfig, up_proj
from pallas_moe.routing import token_rounding_plan, topk_plan
from tests.test_kernels_common import assert_untouched, close, random_weights, random_x


def run_forward(x, plan, w1, w2, config=None):
    out, h = moe_forward(x, plan, w1, w2, interpret=True, config=config)
    out_ref, h_ref = moe_forward_reference(x, plan, w1, w2)
    rows = int(plan.num_rows)
    close(out, out_ref, plan.num_tokens)
    close(h, h_ref, rows)
    assert_untouched(h, rows)


def test_topk_forward_default_config():
    ks = jax.random.split(jax.random.key(60), 4)
    t, d, n, e, k = 40, 128, 128, 4, 2
    x = random_x(ks[0], t, d)
    w1, w2 = random_weights(ks[1], e, d, n)
    plan = topk_plan(jax.random.normal(ks[2], (t, e)), k)
    run_forward(x, plan, w1, w2)


@pytest.mark.slow  # CI time: padded aggregation width: test_widths_that_are_odd_multiples_of_64; TR plans through moe_forward: test_moe_ffn_kernels' bias test [token_rounding]
def test_token_rounding_forward_with_padded_aggregation_width():
    # d = 192 is not a multiple of 128: Y gets padded columns and the output is sliced.
    ks = jax.random.split(jax.random.key(61), 4)
    t, d, n, e, k = 32, 192, 64, 3, 2
    x = random_x(ks[0], t, d)
    w1, w2 = random_weights(ks[1], e, d, n)
    plan = token_rounding_plan(jax.random.normal(ks[2], (t, e)), k, tile=8)
    run_forward(x, plan, w1, w2)


def test_widths_that_are_odd_multiples_of_64():
    # Like the real d = 2880 (45 * 64) and n = 1408 (22 * 64): d = 320 is not a multiple of
    # 128 (padded aggregation width), n = 192 is not a multiple of 128 (64-column blocks).
    ks = jax.random.split(jax.random.key(63), 4)
    t, d, n, e, k = 24, 320, 192, 3, 2
    x = random_x(ks[0], t, d)
    w1, w2 = random_weights(ks[1], e, d, n)
    plan = topk_plan(jax.random.normal(ks[2], (t, e)), k)
    run_forward(x, plan, w1, w2)


@pytest.mark.slow  # up-proj inference mode is covered in test_kernels_up_proj.py
def test_inference_returns_no_h():
    ks = jax.random.split(jax.random.key(62), 4)
    x = random_x(ks[0], 16, 64)
    w1, w2 = random_weights(ks[1], 2, 64, 64)
    plan = topk_plan(jax.random.normal(ks[2], (16, 2)), 1)
    out, h = moe_forward(x, plan, w1, w2, interpret=True, inference=True)
    assert h is None
    close(out, moe_forward_reference(x, plan, w1, w2)[0], 16)


def test_mismatched_inputs_raise():
    x = jnp.zeros((8, 64), jnp.bfloat16)
    plan = topk_plan(jnp.zeros((8, 2)), 1)
    w1, w2 = jnp.zeros((2, 64, 128), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="plan has 2 experts but w_gate_up has 3"):
        moe_forward(x, plan, jnp.zeros((3, 64, 128), jnp.bfloat16),
                    jnp.zeros((3, 64, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="w_down must have shape \\(2, 64, 64\\)"):
        moe_forward(x, plan, w1, jnp.zeros((2, 32, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="plan covers 8 tokens but x has 4"):
        moe_forward(x[:4], plan, w1, w2, interpret=True)
    with pytest.raises(ValueError, match="d=96 must be a multiple of 64"):
        ForwardConfig.for_shape(96, 64)


def _abstract_plan(t, e, k):
    return jax.eval_shape(lambda l: topk_plan(l, k), jax.ShapeDtypeStruct((t, e), jnp.float32))


def _lower(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


# (T, d, n, E, K): the 7B benchmark shape and the real widths d = 2880/7168/1536 with
# n = 1408/2048/768 (T kept small: lowering cost does not depend on it).
LOWERING_SHAPES = [
    (24576, 1536, 256, 128, 8),
    (1024, 2880, 1408, 32, 4),
    (1024, 7168, 2048, 16, 2),
    (1024, 1536, 768, 16, 2),
]


# CI time: every shape lowers with cp.async (the compiled default loader); the TMA loader
# (what interpret mode runs; opt-in compiled) lowers in CI at the 7B shape only, and at
# the other shapes (the same loader over other widths) as slow extras.
@pytest.mark.parametrize("shape, gather", [
    pytest.param(shape, gather, id=f"{'x'.join(map(str, shape))}-{gather}",
                 marks=pytest.mark.slow if gather == "tma" and shape != LOWERING_SHAPES[0] else ())
    for shape in LOWERING_SHAPES for gather in ("cp_async", "tma")
])
def test_forward_lowers_for_cuda(shape, gather):
    t, d, n, e, k = shape
    sds = jax.ShapeDtypeStruct
    config = ForwardConfig.for_shape(d, n, gather=gather)
    _lower(
        lambda x, p, a, b: moe_forward(x, p, a, b, config=config),
        sds((t, d), jnp.bfloat16), _abstract_plan(t, e, k),
        sds((e, d, 2 * n), jnp.bfloat16), sds((e, n, d), jnp.bfloat16),
    )


@pytest.mark.parametrize("kind, completion", [("NVIDIA H100 80GB HBM3", "wait_group"),
                                              ("NVIDIA H200", "mbarrier"), ("", "wait_group")])
def test_pingpong_up_proj_completion_follows_the_device(kind, completion):
    """The ping-pong up-proj's gathered stages complete as measured fastest on each card
    (mbarriers on the H200, the lagged publish on the H100 and by default), and the H200's
    form lowers for cuda at 7B."""
    t, d, n, e, k = 24576, 1536, 256, 128, 8
    up = ForwardConfig.for_shape(d, n, device_kind=kind).up
    assert up.pingpong_ctas and up.gather_completion == completion
    if kind.endswith("H200"):
        sds = jax.ShapeDtypeStruct
        _lower(lambda x, tok, g, w: up_proj(x, tok, g, w, config=up),
               sds((t, d), jnp.bfloat16), sds((t * k,), jnp.int32), sds((e,), jnp.int32),
               sds((e, d, 2 * n), jnp.bfloat16))
        # One [64, 256] weight box per K step from interleaved W1 columns, one N = 256 wgmma,
        # in the ping-pong kernel and with persistent split-M items (4 stages of 48 KB).
        split_m = UpProjConfig(block_m=128, block_n=128, num_stages=4, num_consumers=2,
                               gather="cp_async", fused_gate_up=True, pingpong_ctas=132)
        for fused in (dataclasses.replace(up, fused_gate_up=True), split_m):
            _lower(lambda x, tok, g, w, c=fused: up_proj(x, tok, g, w, config=c,
                                                         gate_up_blocks=128),
                   sds((t, d), jnp.bfloat16), sds((t * k,), jnp.int32), sds((e,), jnp.int32),
                   sds((e, d, 2 * n), jnp.bfloat16))


@pytest.mark.parametrize("kind, d, n, split_m", [
    # CI time (~4.5 s a True case, ~0 a False one): the True cases lower the same config
    # (`split_m_up_config`) at their widths; CI keeps one per branch of the choice, each at
    # its threshold: d > PINGPONG_UP_MAX_D at d = SPLIT_M_UP_MAX_D (4096, 512), and n >=
    # SPLIT_M_UP_MIN_N at the ping-pong's widths (1536, 512), and the H100's choice at
    # (4096, 512). The other True cases are slow extras; the False cases (no lowering) all
    # stay.
    pytest.param("NVIDIA H200", 2048, 768, True, marks=pytest.mark.slow),
    ("NVIDIA H200", 4096, 512, True),
    pytest.param("NVIDIA H200", 2880, 1408, True, marks=pytest.mark.slow),
    ("NVIDIA H200", 7168, 2048, False),
    ("NVIDIA H200", 1536, 512, True),
    pytest.param("NVIDIA H200", 1536, 1024, True, marks=pytest.mark.slow),
    ("NVIDIA H200", 1536, 256, False), ("NVIDIA H100 80GB HBM3", 1536, 1024, False),
    ("NVIDIA H100 80GB HBM3", 4096, 512, True),
    pytest.param("", 2048, 768, True, marks=pytest.mark.slow),
    ("NVIDIA H100 80GB HBM3", 1536, 256, False), ("", 7168, 2048, False),
    # Session 48: also where 128 does not divide n, with 64-column items (gpt-oss-20b's
    # d = n = 2880: 1.433x the cooperative kernel on the H100), on every card.
    ("NVIDIA H100 80GB HBM3", 2880, 2880, True),
    pytest.param("NVIDIA H200", 2880, 2880, True, marks=pytest.mark.slow),
    ("NVIDIA H100 80GB HBM3", 1536, 192, False)])
def test_split_m_up_proj_follows_the_device_and_width(kind, d, n, split_m):
    """Above the ping-pong's widths every card runs the persistent split-M up-proj up to
    SPLIT_M_UP_MAX_D (measured on an H200 at d = 2048, 2880 and 4096, on the H100 at 4096),
    and an H200 at the ping-pong's widths too once experts are wide (n >= SPLIT_M_UP_MIN_N,
    measured there at d = 1536, n = 512 and 1024; the H100 keeps the ping-pong, not
    measured); wider models keep the cooperative kernel (split-M measured 0.854x at d =
    7168 on the H100, session 48). Its items are 128 rows and 128 columns, or, where 128
    does not divide n, 192 rows (three consumers; session 49: 1.116x 128 rows at gpt-oss's
    widths on the H100) and 64 columns. From d = CLUSTER_UP_MIN_D on its items run on
    clusters of two CTAs sharing each weight tile (session 50: 1.03-1.05x at 30B's and
    gpt-oss's widths on the H100, 0.984x at d = 2048). The form lowers for cuda at its
    widths."""
    up = ForwardConfig.for_shape(d, n, device_kind=kind).up
    assert (up.block_m > 64 and up.pingpong_ctas > 0) == split_m, up
    if split_m:
        assert not up.fused_gate_up and up.gather_completion == "mbarrier", up
        assert up.cluster_m == (2 if d >= CLUSTER_UP_MIN_D else 1), up
        narrow = n % 128 != 0
        assert (up.block_m, up.block_n, up.num_consumers, up.num_stages) == (
            (192, 64, 3, 4) if narrow else (128, 128, 2, 4)), up
        t, e, k = 4096, 16, 8
        sds = jax.ShapeDtypeStruct
        for inference in (False, True):
            _lower(lambda x, tok, g, w, i=inference: up_proj(x, tok, g, w, config=up,
                                                             inference=i),
                   sds((t, d), jnp.bfloat16), sds((t * k,), jnp.int32), sds((e,), jnp.int32),
                   sds((e, d, 2 * n), jnp.bfloat16))


@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_wgmma_lag_follows_the_device_and_items(kind):
    """On the H100 the 192-row three-consumer split-M up-proj and the three-stage down-proj
    of 192-column items release each slot as soon as its own step's wgmmas are done
    (`wgmma_lag=0`; session 54: 1.069-1.080x and 1.043-1.065x at gpt-oss's widths); every
    other default keeps lag 1, and the H200 (not measured) keeps lag 1 everywhere. Lag 0
    lowers at gpt-oss's widths."""
    h100 = not kind.endswith("H200")
    gpt_oss = ForwardConfig.for_shape(2880, 2880, num_sms=132, device_kind=kind)
    assert (gpt_oss.up.block_m, gpt_oss.down.block_n, gpt_oss.down.num_stages) == (192, 192, 3)
    assert gpt_oss.up.wgmma_lag == gpt_oss.down.wgmma_lag == (0 if h100 else 1), gpt_oss
    for d, n in ((1536, 256), (2048, 768), (4096, 512), (7168, 2048)):
        cfg = ForwardConfig.for_shape(d, n, num_sms=132, device_kind=kind)
        assert cfg.up.wgmma_lag == cfg.down.wgmma_lag == 1, (d, n, cfg)
    if h100:
        t, d, n, e, k = 4096, 2880, 2880, 16, 4
        sds = jax.ShapeDtypeStruct
        _lower(lambda a, g, w: down_proj(a, g, w, config=gpt_oss.down),
               sds((t * k, n), jnp.bfloat16), sds((e,), jnp.int32), sds((e, n, d), jnp.bfloat16))


def test_each_kernel_lowers_at_7b_production_config():
    t, d, n, e, k = 24576, 1536, 256, 128, 8
    p = t * k
    cfg = ForwardConfig.for_shape(d, n)
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    _lower(lambda x, tok, g, w: up_proj(x, tok, g, w, config=cfg.up),
           sds((t, d), jnp.bfloat16), sds((p,), i32), sds((e,), i32), sds((e, d, 2 * n), jnp.bfloat16))
    _lower(lambda a, g, w: down_proj(a, g, w, config=cfg.down),
           sds((p, n), jnp.bfloat16), sds((e,), i32), sds((e, n, d), jnp.bfloat16))
    _lower(lambda y, r, o, s: aggregate(y, r, o, s, config=cfg.aggregate),
           sds((p, d), jnp.bfloat16), sds((p,), i32), sds((t + 1,), i32), sds((p,), jnp.float32))


@pytest.mark.parametrize("inference, fused", [(True, False), (False, False), (False, True)])
def test_pingpong_up_proj_lowers_for_cuda_at_30b(inference, fused):
    """The ping-pong up-proj off its default widths (d = 4096, 64-step items), in inference
    mode (A only, one-tile epilogue buffers) and with one N = 256 wgmma per K step
    (`fused_gate_up`, on W1 interleaved per block_n)."""
    t, d, n, e, k = 32768, 4096, 512, 128, 8
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    cfg = UpProjConfig(block_n=128, num_stages=5, num_consumers=2, gather="cp_async",
                       pingpong_ctas=132, fused_gate_up=fused)
    _lower(lambda x, tok, g, w: up_proj(x, tok, g, w, config=cfg, inference=inference,
                                        gate_up_blocks=128 if fused else 0),
           sds((t, d), jnp.bfloat16), sds((t * k,), i32), sds((e,), i32),
           sds((e, d, 2 * n), jnp.bfloat16))


@pytest.mark.parametrize("shape", [(32768, 4096, 512, 128, 8), (24576, 1536, 256, 128, 8)],
                         ids=["30b_clusters", "7b_pingpong"])
def test_wgmma_lag_0_up_proj_lowers_for_cuda(shape):
    """The H100 default up-proj and down-proj with each slot released once its own step's
    wgmmas are done (`wgmma_lag=0`, what `forward.py --up-sweep lag --down-sweep lag` times)
    lower for cuda: split-M up-proj items on clusters at 30B, the ping-pong at 7B."""
    from tests.cuda_target import h100_target

    t, d, n, e, k = shape
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    with h100_target():
        default = ForwardConfig.for_shape(d, n)
        up = dataclasses.replace(default.up, wgmma_lag=0)
        down = dataclasses.replace(default.down, wgmma_lag=0)
        assert up.pingpong_ctas and up.cluster_m == (2 if d == 4096 else 1), up
        _lower(lambda x, tok, g, w: up_proj(x, tok, g, w, config=up),
               sds((t, d), jnp.bfloat16), sds((t * k,), i32), sds((e,), i32),
               sds((e, d, 2 * n), jnp.bfloat16))
        _lower(lambda a, g, w: down_proj(a, g, w, config=down),
               sds((t * k, n), jnp.bfloat16), sds((e,), i32), sds((e, n, d), jnp.bfloat16))


@pytest.mark.parametrize("shape", [(8192, 2880, 2880, 32, 4), (16384, 2048, 768, 128, 8)],
                         ids=["gpt_oss_64_columns", "qwen3_128_columns"])
def test_three_consumer_split_m_up_proj_lowers_for_cuda(shape):
    """Split-M items of 192 rows (three consumers of 64 rows sharing each weight tile, what
    `forward.py --up-sweep rows` times) lower for cuda at production widths: 64-column items
    with 4 stages at gpt-oss's, 128-column items with 3 (4 do not fit beside the epilogue
    tiles) at Qwen3-30B-A3B's."""
    t, d, n, e, k = shape
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    cfg = dataclasses.replace(split_m_up_config(132, n, rows=192), gather="cp_async")
    stages = 4 if n % 128 else 3
    assert (cfg.block_m, cfg.num_consumers, cfg.num_stages) == (192, 3, stages)
    _lower(lambda x, tok, g, w: up_proj(x, tok, g, w, config=cfg),
           sds((t, d), jnp.bfloat16), sds((t * k,), i32), sds((e,), i32),
           sds((e, d, 2 * n), jnp.bfloat16))
    with pytest.raises(ValueError, match=f"needs .* B of SMEM for {stages + 1} stages"):
        _lower(lambda x, tok, g, w: up_proj(x, tok, g, w, config=dataclasses.replace(
                   cfg, num_stages=stages + 1)),
               sds((t, d), jnp.bfloat16), sds((t * k,), i32), sds((e,), i32),
               sds((e, d, 2 * n), jnp.bfloat16))


@pytest.mark.parametrize("shape", [
    pytest.param((24576, 1536, 256, 128, 8), marks=pytest.mark.slow),  # CI time: 30B's
    (32768, 4096, 512, 128, 8),  # split-M items on clusters: the most of the kernel
    pytest.param((8192, 2880, 2880, 32, 4), marks=pytest.mark.slow),
], ids=["7b_pingpong", "30b_clusters", "gpt_oss_192_rows"])
def test_audit_sweep_up_proj_lowers_for_cuda(shape):
    """Every candidate of `forward.py --up-sweep audit` (the default up-proj, then with
    `no_auto_barriers=True`, with `rebalance_registers=False`, and on the TMA row gather
    with `row_unroll` 4 and 16) lowers for cuda at the benchmark's widths, each option
    reaching the kernel: no setmaxnreg with the even register split, the TMA gather's
    longer unrolled row loop with `row_unroll=16`."""
    from benchmarks.forward import audit_up_cfgs
    from tests.cuda_target import h100_target

    t, d, n, e, k = shape
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    t = 512  # lowering cost does not depend on T
    with h100_target():
        cfgs = audit_up_cfgs(d, n)
        base = ForwardConfig.for_shape(d, n).up
        assert cfgs[0] == base and base.gather == "cp_async" and len(cfgs) == 5, cfgs
        texts = [_lower(lambda x, tok, g, w, cfg=cfg: up_proj(x, tok, g, w, config=cfg),
                        sds((t, d), jnp.bfloat16), sds((t * k,), i32), sds((e,), i32),
                        sds((e, d, 2 * n), jnp.bfloat16)).as_text() for cfg in cfgs]
    assert [c.no_auto_barriers for c in cfgs] == [False, True, False, False, False]
    assert [c.gather for c in cfgs] == ["cp_async"] * 3 + ["tma"] * 2
    assert [t.count("setmaxnreg") > 0 for t in texts] == [True, True, False, True, True]
    assert len(set(texts)) == 5 and len(texts[4]) > len(texts[3])  # row_unroll reaches it


def test_cluster_split_m_up_proj_lowers_for_cuda():
    """Split-M items on clusters of two CTAs (`cluster_m=2`, the weight tiles multicast to
    both) lower for cuda, training and inference, where they are opt-in: the Qwen3-30B-A3B
    widths (below CLUSTER_UP_MIN_D). `test_split_m_up_proj_follows_the_device_and_width`
    lowers them where they are the default (30B's and gpt-oss's widths)."""
    t, d, n, e, k = 16384, 2048, 768, 128, 8
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    assert ForwardConfig.for_shape(d, n).up.cluster_m == 1
    up = dataclasses.replace(split_m_up_config(132, n, d=d, cluster_m=2), gather="cp_async")
    assert up.pingpong_ctas and up.block_m > 64 and up.tile_rows == 2 * up.block_m, up
    for inference in (False, True):
        _lower(lambda x, tok, g, w, i=inference: up_proj(x, tok, g, w, config=up, inference=i),
               sds((t, d), jnp.bfloat16), sds((t * k,), i32), sds((e,), i32),
               sds((e, d, 2 * n), jnp.bfloat16))


def test_schedule_kernel_forward_is_bitwise_the_default():
    """`ForwardConfig.schedule_impl="kernel"`: the tile metadata from one Pallas program
    (`schedules.forward_schedule_kernel`, interpreted here), bit for bit the jnp formulas'
    (tests/test_schedules.py), so the whole forward is bitwise the default's."""
    ks = jax.random.split(jax.random.key(64), 4)
    t, d, n, e, k = 16, 64, 64, 4, 2
    x = random_x(ks[0], t, d)
    w1, w2 = random_weights(ks[1], e, d, n)
    plan = topk_plan(jax.random.normal(ks[2], (t, e)), k)
    config = ForwardConfig.for_shape(d, n, num_sms=4)
    assert config.schedule_impl == "jnp"
    want = moe_forward(x, plan, w1, w2, interpret=True, config=config)
    kernel = dataclasses.replace(config, schedule_impl="kernel")
    text = str(jax.make_jaxpr(lambda x: moe_forward(x, plan, w1, w2, interpret=True, config=kernel))(x))
    assert "moe_forward_schedules" in text
    got = moe_forward(x, plan, w1, w2, interpret=True, config=kernel)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert bool(jnp.array_equal(g, w, equal_nan=True))


def test_schedule_impl_errors():
    with pytest.raises(ValueError, match=r"schedule_impl must be one of \('jnp', 'kernel', 'auto'\)"):
        ForwardConfig(schedule_impl="interpret")
    with pytest.raises(ValueError, match="schedule_impl must be one of"):
        ForwardConfig.for_shape(128, 128, schedule_impl="triton")


def test_fused_gate_up_forward_config_raises():
    """The fused up-proj reads W1 interleaved per block_n only and the op's W1 is the halves
    layout, so a forward config that fuses is rejected when it is built."""
    match = r"up.fused_gate_up=True cannot run in the forward: the op's W1 is the halves layout"
    fused = dataclasses.replace(split_m_up_config(132, 256), fused_gate_up=True)
    with pytest.raises(ValueError, match=match):
        ForwardConfig(up=fused)
    with pytest.raises(ValueError, match=match):
        ForwardConfig.for_shape(2048, 256, num_sms=132, up=fused)


@pytest.mark.parametrize("num_tokens", [1, 8, 128])
def test_schedule_kernel_lowers_for_cuda(num_tokens):
    """The forward's schedule kernel (`moe_forward_schedules`, Triton) lowers at the
    Qwen3-30B-A3B widths (E = 128, K = 8), in the whole kernel-by-kernel forward."""
    from tests.cuda_target import h100_target

    d, n, e, k = 2048, 768, 128, 8
    sds = jax.ShapeDtypeStruct
    config = ForwardConfig.for_shape(d, n, num_sms=132, schedule_impl="kernel")
    with h100_target():
        text = _lower(
            lambda x, p, a, b: moe_forward(x, p, a, b, config=config, inference=True),
            sds((num_tokens, d), jnp.bfloat16), _abstract_plan(num_tokens, e, k),
            sds((e, d, 2 * n), jnp.bfloat16), sds((e, n, d), jnp.bfloat16),
        ).as_text()
    assert "moe_forward_schedules" in text and "moe_up_proj" in text
