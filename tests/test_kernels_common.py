"""Shared cases for the forward-kernel tests, plus tests of the per-plan tile metadata.

The kernel tests run the Mosaic GPU kernels in interpret mode on CPU. Interpret mode fills
fresh buffers (kernel outputs included) with NaN, so every output starts poisoned: a real row
the kernel forgot to write stays NaN and fails the comparison, and rows a kernel must not
touch (padding rows) are checked to still be NaN.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_moe.kernels import _common
from pallas_moe.routing.plan import plan_from_assignment, tile_schedule


def random_weights(key, num_experts, d, n):
    k1, k2, k3 = jax.random.split(key, 3)
    w1 = (jax.random.normal(k1, (num_experts, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(
        jnp.bfloat16
    )
    w2 = (jax.random.normal(k2, (num_experts, n, d), jnp.float32) / np.sqrt(n)).astype(
        jnp.bfloat16
    )
    return w1, w2


def random_x(key, num_tokens, d):
    return jax.random.normal(key, (num_tokens, d), jnp.float32).astype(jnp.bfloat16)


def assignment_plan(key, num_tokens, num_experts, *, p=0.3, empty=(), only=None, extra=0):
    """Plan from a random boolean assignment (ragged groups, any number of rows per token).

    `empty`: experts that get no rows. `only`: a single expert that gets every token.
    `extra`: padding rows past T*E.
    """
    k1, k2 = jax.random.split(key)
    sel = jax.random.bernoulli(k1, p, (num_tokens, num_experts))
    if only is not None:
        sel = jnp.zeros_like(sel).at[:, only].set(True)
    for e in empty:
        sel = sel.at[:, e].set(False)
    weights = jax.random.uniform(k2, (num_tokens, num_experts), jnp.float32, 0.1, 1.0)
    return plan_from_assignment(sel, weights, sel, num_tokens * num_experts + extra)


def close(got, want, rows, tol=1e-2):
    """Relative Frobenius error over the first `rows` rows; NaN (unwritten) fails."""
    g = np.asarray(got[:rows], np.float32)
    w = np.asarray(want[:rows], np.float32)
    assert np.all(np.isfinite(g)), "unwritten (NaN) or non-finite rows in the kernel output"
    err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
    assert err < tol, f"relative error {err:.3e} >= {tol}"


def assert_untouched(got, start, stop=None):
    """Rows [start, stop) still hold interpret mode's NaN fill."""
    g = np.asarray(got[start:stop], np.float32)
    assert np.all(np.isnan(g)), "kernel wrote rows it does not own"


def races_found() -> bool:
    # Private interpret-mode API: the race detector's verdict for the last detect_races run.
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    return bool(get_races().races_found)


@pytest.mark.parametrize("block_m", [8, 64])
def test_tile_meta_covers_every_row_once(block_m):
    plan = assignment_plan(jax.random.key(0), 37, 5, empty=(2,))
    meta = _common.tile_meta(plan.group_sizes, plan.token_ids, block_m)
    sched = tile_schedule(plan.group_sizes, plan.capacity, block_m)
    np.testing.assert_array_equal(meta.expert, sched.expert)
    rows = int(plan.num_rows)
    owner = np.full(plan.capacity, -1)
    for t in range(meta.num_tiles):
        s, nr = int(meta.row_start[t]), int(meta.num_rows[t])
        assert nr <= block_m
        assert np.all(owner[s:s + nr] == -1)
        owner[s:s + nr] = int(meta.expert[t])
        ids = np.asarray(meta.row_ids[t])
        if nr:
            np.testing.assert_array_equal(ids[:nr], np.asarray(plan.token_ids[s:s + nr]))
            assert np.all(ids[nr:] == ids[nr - 1])  # clamped, in bounds
    np.testing.assert_array_equal(owner[:rows], np.asarray(plan.expert_ids[:rows]))
    assert np.all(owner[rows:] == -1)


@pytest.mark.parametrize("block_m", [8, 64])
def test_aligned_tile_meta_stays_inside_aligned_blocks(block_m):
    plan = assignment_plan(jax.random.key(1), 41, 6, empty=(0, 4), extra=13)
    meta = _common.aligned_tile_meta(plan.group_sizes, plan.capacity, block_m)
    assert meta.num_tiles <= -(-plan.capacity // block_m) + plan.num_experts
    rows = int(plan.num_rows)
    owner = np.full(plan.capacity, -1)
    for t in range(meta.num_tiles):
        s, nr = int(meta.row_start[t]), int(meta.num_rows[t])
        if nr == 0:
            continue
        assert s // block_m == (s + nr - 1) // block_m  # one aligned block
        assert np.all(owner[s:s + nr] == -1)
        owner[s:s + nr] = int(meta.expert[t])
    np.testing.assert_array_equal(owner[:rows], np.asarray(plan.expert_ids[:rows]))
    assert np.all(owner[rows:] == -1)



# One expert shard's rows in `benchmarks/chunked_down_proj.py`'s 7b-ep8 (16 local experts,
# 24602 rows): its down-proj has 128-row tiles and 12 column blocks, 132 CTAs on an H100.
SEVEN_B_EP8_GROUPS = [1562, 1477, 1531, 1607, 1571, 1497, 1578, 1491, 1576, 1465, 1527, 1532,
                      1548, 1508, 1479, 1653]


def tile_starts(group_sizes, block_m) -> set[int]:
    """First rows of `aligned_tile_meta`'s real tiles: block_m multiples and group starts."""
    total = sum(group_sizes)
    cuts = set(range(0, total, block_m)) | set(np.cumsum([0, *group_sizes[:-1]]).tolist())
    return {int(c) for c in cuts if c < total}


def chunk_waves(group_sizes, capacity, num_chunks, chunk_rows, *, block_m, items_per_tile,
                wave, equal_rows=False):
    """(row bounds, waves of each chunk's call) for `wave_chunk_bounds`, or with
    `equal_rows` for chunks of `chunk_rows` rows each (the old layout)."""

    @jax.jit
    def bounds_and_tiles(group_sizes):
        meta = _common.aligned_tile_meta(group_sizes, capacity, block_m)
        if equal_rows:
            total = jnp.sum(group_sizes)
            bounds = jnp.minimum(jnp.arange(num_chunks + 1) * chunk_rows, total)
        else:
            bounds = _common.wave_chunk_bounds(
                meta, num_chunks, chunk_rows, items_per_tile=items_per_tile, wave=wave
            )
        return bounds, _common.tile_chunks(meta, bounds, chunk_rows).bounds[0]

    bounds, tile_bounds = (np.asarray(b) for b in bounds_and_tiles(jnp.asarray(group_sizes, jnp.int32)))
    items = np.diff(tile_bounds) * items_per_tile
    return bounds, -(-items // wave)


@pytest.mark.parametrize("num_chunks", [2, 4])
def test_wave_chunks_of_7b_ep8_run_the_whole_calls_waves(num_chunks):
    """Counting at the 7b-ep8 shard: 208 tiles x 12 column blocks = 2496 items, 19 waves of
    132. Equal-row chunks end on partial waves (20 in all); `RowChunking`'s take 19."""
    from pallas_moe.ops.row_chunks import RowChunking, chunk_layout

    rows = sum(SEVEN_B_EP8_GROUPS)
    capacity = -(-rows // 128) * 128
    chunking = RowChunking.for_shape("mosaic", 1536, 256, capacity, num_chunks)  # H100: 132 SMs
    assert (chunking.block_m, chunking.items_per_tile, chunking.wave) == (128, 12, 132)
    shape = dict(block_m=128, items_per_tile=12, wave=132)
    equal_rows = chunk_layout(capacity, num_chunks, 128)[0]
    _, old = chunk_waves(SEVEN_B_EP8_GROUPS, capacity, num_chunks, equal_rows, equal_rows=True, **shape)
    bounds, new = chunk_waves(SEVEN_B_EP8_GROUPS, capacity, num_chunks, chunking.rows, **shape)
    np.testing.assert_array_equal(bounds, chunking.bounds(jnp.asarray(SEVEN_B_EP8_GROUPS)))
    assert old.sum() == 20 and new.sum() == 19
    assert bounds[0] == 0 and bounds[-1] == rows and set(bounds[1:-1]) <= tile_starts(SEVEN_B_EP8_GROUPS, 128)
    assert np.all(np.diff(bounds) > 0) and np.all(np.diff(bounds) <= chunking.rows)
    assert max(new) - min(new) <= 1  # balanced


@pytest.mark.parametrize("num_chunks", [2, 3, 5])
def test_wave_chunks_hold_every_row_at_full_capacity(num_chunks):
    """Rows filling the capacity and buffers of the equal split (no room to move a bound),
    one expert holding most: bounds stay on tile boundaries, each chunk within its buffer,
    and together they cover every row in order."""
    groups = [3000, 7, 0, 130, 9]
    block_m, capacity = 64, sum(groups)
    chunk_rows = -(-capacity // (num_chunks * block_m)) * block_m
    bounds, _ = chunk_waves(groups, capacity, num_chunks, chunk_rows, block_m=block_m,
                            items_per_tile=3, wave=7)
    assert bounds[0] == 0 and bounds[-1] == capacity and set(bounds[1:-1]) <= tile_starts(groups, block_m)
    assert np.all(np.diff(bounds) >= 0) and np.all(np.diff(bounds) <= chunk_rows)


def test_gather_config_errors_name_the_field():
    """A bad row loader or stage-publishing mode is refused with the field's name; dH has
    no stage-publishing mode since session 64 (the lagged publish only)."""
    from pallas_moe.kernels.dh import DHConfig
    from pallas_moe.kernels.up_proj import UpProjConfig
    from pallas_moe.kernels.weight_grad import WeightGradConfig

    for cls in (UpProjConfig, WeightGradConfig):
        with pytest.raises(ValueError, match="config.gather_completion"):
            _common.require_gather_mode(
                cls(gather="cp_async", num_consumers=2, num_stages=3, gather_completion="spin")
            )
    for cls in (UpProjConfig, DHConfig, WeightGradConfig):
        with pytest.raises(ValueError, match="config.gather must be"):
            _common.require_gather_mode(cls(gather="ldg"))
    _common.require_gather_mode(DHConfig(gather="cp_async", num_consumers=2, num_stages=3))


def test_stage_arrivals_follow_the_loader():
    """TMA rows each arrive on `full`; the lagged cp.async publish arrives once; hardware-
    tracked cp.async stages add nothing there (their own mbarriers count the loads)."""
    from pallas_moe.kernels.up_proj import UpProjConfig

    tma = UpProjConfig(gather="tma", num_consumers=2)
    lagged = UpProjConfig(gather="cp_async", num_consumers=2, gather_completion="wait_group")
    tracked = UpProjConfig(gather="cp_async", num_consumers=2, gather_completion="mbarrier")
    assert _common.gather_full_arrivals(tma, 64, interpret=False) == 64
    assert _common.gather_full_arrivals(lagged, 64, interpret=False) == 1
    assert _common.gather_full_arrivals(tracked, 64, interpret=False) == 0
    # dH publishes cp.async stages by the lagged wait only (session 64).
    from pallas_moe.kernels.dh import DHConfig
    dh = DHConfig(gather="cp_async", num_consumers=2, num_stages=4)
    assert _common.gather_full_arrivals(dh, 64, interpret=False) == 1
    # Interpret mode runs the TMA loader whatever the config says.
    assert _common.gather_full_arrivals(tracked, 64, interpret=True) == 64
    assert _common.uses_stage_mbarriers(tracked, interpret=False)
    assert not _common.uses_stage_mbarriers(tracked, interpret=True)
    assert not _common.uses_stage_mbarriers(lagged, interpret=False)


@pytest.mark.parametrize("completion, marker, absent", [
    ("mbarrier", "cp.async.mbarrier.arrive", "cp.async.wait.group"),
    ("wait_group", "cp.async.wait.group", "cp.async.mbarrier.arrive"),
])
def test_cp_async_stage_publishing_lowers_for_cuda(completion, marker, absent):
    """Both ways of publishing a cp.async stage lower for cuda at the 7B production blocks
    (interpret mode cannot run cp.async; the H100 tests in test_gpu.py run both)."""
    import importlib

    from tests.cuda_target import h100_target

    up = importlib.import_module("pallas_moe.kernels.up_proj")
    T, d, n, E, P = 4096, 1536, 256, 16, 4096 * 8
    cfg = up.UpProjConfig(block_m=64, block_n=128, num_stages=3, num_consumers=2,
                          gather="cp_async", gather_completion=completion)
    args = (jax.ShapeDtypeStruct((T, d), jnp.bfloat16), jax.ShapeDtypeStruct((P,), jnp.int32),
            jax.ShapeDtypeStruct((E,), jnp.int32), jax.ShapeDtypeStruct((E, d, 2 * n), jnp.bfloat16))
    f = jax.jit(lambda x, t, g, w: up.up_proj(x, t, g, w, config=cfg))
    with h100_target():
        text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert marker in text and absent not in text


@pytest.mark.parametrize("approx", [False, True])
def test_approx_math_reaches_the_swiglu_kernels(approx):
    """`approx_math` lowers the up-proj's, dH's and the decode megakernel's exp to
    `ex2.approx` (and only then), at the 7B production blocks. Interpret mode computes the
    exact exp either way, so the H100 tests check the approximate kernels against the
    reference (`tests/test_gpu.py`, `tests/test_gpu_decode.py`)."""
    import importlib

    from pallas_moe.kernels.config import KernelConfig
    from pallas_moe.kernels.decode import DecodeConfig, moe_decode
    from pallas_moe.kernels.dh import dh_kernel
    from pallas_moe.routing import topk_plan
    from tests.cuda_target import h100_target

    up = importlib.import_module("pallas_moe.kernels.up_proj")
    T, d, n, E, P = 4096, 1536, 256, 16, 4096 * 8
    cfg = KernelConfig.for_shape(d, n, approx_math=approx)
    decode_cfg = KernelConfig.for_shape(
        d, n, approx_math=approx, decode=DecodeConfig.for_shape(d, n, num_sms=132)
    ).forward.decode
    sds, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    up_f = jax.jit(lambda x, t, g, w: up.up_proj(x, t, g, w, config=cfg.forward.up))
    dh_f = jax.jit(lambda o, h, t, g, s, w: dh_kernel(o, h, t, g, s, w, config=cfg.backward.dh))
    Td = 8
    dec_plan = jax.eval_shape(lambda l: topk_plan(l, 8, impl="sort"), sds((Td, E), jnp.float32))
    dec_f = jax.jit(lambda x, p, w1, w2: moe_decode(x, p, w1, w2, config=decode_cfg))
    with h100_target():
        texts = [
            up_f.trace(sds((T, d), bf16), sds((P,), i32), sds((E,), i32),
                       sds((E, d, 2 * n), bf16)).lower(lowering_platforms=("cuda",)).as_text(),
            dh_f.trace(sds((T, d), bf16), sds((P, 2 * n), bf16), sds((P,), i32), sds((E,), i32),
                       sds((P,), jnp.float32), sds((E, n, d), bf16),
                       ).lower(lowering_platforms=("cuda",)).as_text(),
            dec_f.trace(sds((Td, d), bf16), dec_plan, sds((E, d, 2 * n), bf16),
                        sds((E, n, d), bf16),
                        ).lower(lowering_platforms=("cuda",)).as_text(),
        ]
    for text in texts:
        assert ("ex2.approx" in text) == approx


def test_kernel_config_rejects_mismatched_approx_math():
    """The backward recomputes A from H: the forward's and backward's exp must agree, and a
    config left None counts as its for_shape default (the approximate exp)."""
    import dataclasses

    from pallas_moe.kernels.config import KernelConfig
    from pallas_moe.kernels.decode import DecodeConfig
    from pallas_moe.kernels.dh import DHConfig
    from pallas_moe.kernels.up_proj import UpProjConfig

    assert UpProjConfig().approx_math and DHConfig().approx_math and DecodeConfig().approx_math
    cfg = KernelConfig.for_shape(1536, 256)
    assert cfg.forward.up.approx_math and cfg.backward.dh.approx_math
    exact = KernelConfig.for_shape(1536, 256, approx_math=False)
    assert not exact.forward.up.approx_math and not exact.backward.dh.approx_math
    exact_dh = dataclasses.replace(cfg.backward.dh, approx_math=False)
    with pytest.raises(ValueError, match="approx_math"):
        KernelConfig(forward=cfg.forward, backward=dataclasses.replace(cfg.backward, dh=exact_dh))
    KernelConfig(forward=cfg.forward)  # backward None: its defaults are approximate too
    with pytest.raises(ValueError, match="approx_math"):
        KernelConfig(forward=exact.forward)  # exact forward, approximate default backward
    with pytest.raises(ValueError, match="approx_math"):
        KernelConfig(backward=exact.backward)
    # The decode megakernel's exp follows approx_math; a mismatch names its field.
    for approx in (False, True):
        dec = KernelConfig.for_shape(
            1536, 256, approx_math=approx, decode=DecodeConfig.for_shape(1536, 256, num_sms=4)
        )
        assert dec.forward.decode.approx_math == dec.backward.dh.approx_math == approx
    with pytest.raises(ValueError, match="forward.decode.approx_math"):
        KernelConfig(
            forward=dataclasses.replace(
                cfg.forward, decode=DecodeConfig.for_shape(1536, 256, num_sms=4, approx_math=False)
            ),
            backward=cfg.backward,
        )


def test_kernel_config_sets_the_split_dhs_da_dtype():
    """`KernelConfig.for_shape(dh_da_dtype=...)`: None keeps `BackwardConfig.for_shape`'s
    choice (bf16 where it splits dH, d >= 2048); "float32" keeps the split with dA' in f32;
    below d = 2048 (the fused dH) only "float32" is valid, and "bfloat16" is refused naming
    the field."""
    from pallas_moe.kernels.config import KernelConfig

    wide = KernelConfig.for_shape(4096, 512, num_sms=132)
    assert wide.backward.dh_gemm is not None and wide.backward.dh_da_dtype == "bfloat16"
    exact = KernelConfig.for_shape(4096, 512, num_sms=132, dh_da_dtype="float32")
    assert exact.backward.dh_gemm == wide.backward.dh_gemm
    assert exact.backward.dh_da_dtype == "float32"
    narrow = KernelConfig.for_shape(1536, 256, num_sms=132, dh_da_dtype="float32")
    assert narrow.backward.dh_gemm is None and narrow.backward.dh_da_dtype == "float32"
    with pytest.raises(ValueError, match="dh_da_dtype='bfloat16' is the split dH's"):
        KernelConfig.for_shape(1536, 256, num_sms=132, dh_da_dtype="bfloat16")
    with pytest.raises(ValueError, match="dh_da_dtype must be"):
        KernelConfig.for_shape(4096, 512, num_sms=132, dh_da_dtype="float16")


def test_identical_kernels_share_one_hash_and_compilation(monkeypatch):
    """Mosaic GPU compiles one kernel per `kernel_hash`; Pallas stamps every module with a
    counter (`mosaic_gpu.dump_basename`), so without `pallas_moe._kernel_dedup` the same
    MoE layer called twice lowers to different hashes and compiles twice. With it, the
    two layers' kernels hash alike (and different kernels still differ); with a
    `MOSAIC_GPU_DUMP*` variable set the counter stays, for distinct dump names."""
    import os
    import re

    import pallas_moe as pm
    from pallas_moe.kernels.config import KernelConfig
    from tests.cuda_target import h100_target

    T, d, n, E, K = 512, 256, 128, 8, 2
    cfg = KernelConfig.for_shape(d, n, num_sms=132)

    def layer(x, logits, w1, w2):
        plan = pm.routing.topk_plan(logits, K)
        return pm.moe_ffn(x, plan, w1, w2, backend="mosaic", config=cfg)

    def two_layers(x, logits, a1, a2, b1, b2):
        return layer(layer(x, logits, a1, a2), logits, b1, b2)

    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    args = (sds((T, d), bf), sds((T, E), jnp.float32), sds((E, d, 2 * n), bf),
            sds((E, n, d), bf), sds((E, d, 2 * n), bf), sds((E, n, d), bf))

    def kernel_hashes():
        with h100_target():
            # A fresh function each time: jit caches lowerings per function.
            fresh = jax.jit(lambda *a: two_layers(*a))
            text = fresh.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r'kernel_hash = "([^"]*)"', text)

    for name in [n for n in os.environ if n.startswith("MOSAIC_GPU_DUMP")]:
        monkeypatch.delenv(name)
    hashes = kernel_hashes()
    half = len(hashes) // 2
    assert len(hashes) == 2 * half and half >= 3  # routing, up-proj, down-proj, aggregation
    assert hashes[:half] == hashes[half:]
    assert len(set(hashes[:half])) == half
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", "/tmp/unused")
    dumped = kernel_hashes()
    assert len(set(dumped)) == len(dumped)


@pytest.mark.parametrize("env, threads", [
    ({"PJRT_NPROC": "2"}, 2), ({"PJRT_NPROC": "32"}, 32),
    ({"NPROC": "4"}, 4), ({"PJRT_NPROC": "64", "NPROC": "1"}, 64)])
def test_interpret_mode_warns_on_a_cpu_pool_that_can_deadlock(monkeypatch, env, threads):
    """Interpret mode names the XLA CPU pool size it will run on (PJRT_NPROC, else NPROC,
    else the usable cores) and warns when it is under `INTERPRET_MIN_CPU_THREADS`, where
    its blocked callbacks can take every pool thread and hang a jitted kernel; compiled mode
    (`interpret=False`) never warns."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_moe._xla_flags import xla_cpu_pool_threads
    from pallas_moe.kernels._common import INTERPRET_MIN_CPU_THREADS, interpret_params

    for var in ("PJRT_NPROC", "NPROC"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert xla_cpu_pool_threads() == threads
    params = plgpu.InterpretGPUParams(detect_races=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert interpret_params(False) is None
        assert interpret_params(True, detect_races=True) == params
        assert interpret_params(params) is params
    deadlock = [w for w in caught if "can deadlock" in str(w.message)]
    if threads < INTERPRET_MIN_CPU_THREADS:
        assert len(deadlock) == 2 and all(w.category is RuntimeWarning for w in deadlock)
        assert f"pool of {threads} threads" in str(deadlock[0].message)
        assert f"PJRT_NPROC={INTERPRET_MIN_CPU_THREADS}" in str(deadlock[0].message)
    else:
        assert not deadlock


@pytest.mark.parametrize("consumers", range(1, 8))
def test_consumer_registers_come_from_what_the_producer_frees(consumers):
    """`setmaxnreg.inc` only takes registers the CTA's producer released (session 56: four
    dH consumers asking for 112 each, beside a launch count of 96, hung on the H100). The
    consumers' raise must fit in the producer's drop, and the defaults' counts stay."""
    launch = _common.launch_registers(consumers + 1)
    assert launch * 128 * (consumers + 1) <= 65536 and launch % 8 == 0
    raised = _common.consumer_registers(consumers)
    assert raised % 8 == 0 and raised <= 240
    freed = (launch - _common.PRODUCER_REGISTERS) * 128
    assert max(raised - launch, 0) * 128 * consumers <= freed
    assert {1: 240, 2: 232, 3: 152, 4: 104}.get(consumers, raised) == raised
