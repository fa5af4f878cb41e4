"""GPU-only checks of the decode megakernel (`pallas_moe/kernels/decode.py`) on a Hopper GPU.

    PYTHONPATH=. timeout 900 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py

The Qwen3-30B-A3B MoE layer (d=2048, n=768, E=128, K=8), routed by `topk_plan` over fresh
random logits, against the `xla` backend. Outputs are produced right after a NaN-filled buffer
is freed, so a row the kernel forgot to write, or a slab row read before its producer wrote it,
shows up as NaN. A deadlock hangs the process: run under `timeout`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe as pm
from pallas_moe.kernels.decode import DecodeConfig, moe_decode

from tests.test_gpu import _poison, on_hopper
from tests.test_schedules import routing_logits
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs a Hopper GPU")]

D, N, E, K = 2048, 768, 128, 8
VARIANTS = {
    "static": dict(),
    "dynamic": dict(scheduler="dynamic"),
    "unfused": dict(fused=False),
    # The per-plan metadata from one Pallas program instead of jnp (`decode_meta.py`).
    "static_meta": dict(meta_impl="kernel"),
    "dynamic_meta": dict(scheduler="dynamic", meta_impl="kernel"),
}


@functools.cache
def _weights():
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = (jax.random.normal(k1, (E, D, 2 * N), jnp.float32) * D**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (E, N, D), jnp.float32) * N**-0.5).astype(jnp.bfloat16)
    return w1, w2


@functools.cache
def _decode_fn(variant: str, write_h: bool = False):
    config = DecodeConfig.for_shape(D, N, **VARIANTS[variant])
    return jax.jit(lambda x, p, w1, w2: moe_decode(x, p, w1, w2, config=config, write_h=write_h))


@functools.cache
def _reference_fn():
    return jax.jit(lambda x, p, w1, w2: pm.moe_ffn(x, p, w1, w2, backend="xla"))


def _case(num_tokens, seed, routing="random"):
    kx, kl = jax.random.split(jax.random.key(1000 * num_tokens + seed))
    x = jax.random.normal(kx, (num_tokens, D), jnp.float32).astype(jnp.bfloat16)
    logits = routing_logits(kl, num_tokens, E, routing)
    plan = jax.jit(lambda l: pm.routing.topk_plan(l, K))(logits)
    return x, plan


def _rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got)), "unwritten or prematurely read rows (NaN) in the output"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _run(variant, x, plan, write_h=False):
    w1, w2 = _weights()
    # Enough for the output and both slabs of the largest T.
    _poison((x.shape[0] * D + plan.capacity * (N + D + 2 * N) + 128 * 64 * (N + D)) * 2)
    return jax.block_until_ready(_decode_fn(variant, write_h)(x, plan, w1, w2))


@pytest.mark.parametrize(
    "num_tokens, variant",
    [(t, "static") for t in (1, 8, 32, 64, 128, 512, 1024)]
    + [(t, "dynamic") for t in (1, 128, 1024)]
    + [(t, "unfused") for t in (8, 512)]
    + [(t, "static_meta") for t in (1, 8, 32, 128, 1024)]
    + [(t, "dynamic_meta") for t in (1, 64)],
)
def test_matches_xla(num_tokens, variant):
    x, plan = _case(num_tokens, seed=0)
    w1, w2 = _weights()
    out, _ = _run(variant, x, plan)
    assert _rel_err(out, _reference_fn()(x, plan, w1, w2)) < 1e-2


@pytest.mark.parametrize("routing", ["skewed", "empty_experts", "one_expert_all_tokens"])
@pytest.mark.parametrize("variant", ["static", "dynamic"])
def test_routing_edge_cases(routing, variant):
    x, plan = _case(256, seed=1, routing=routing)
    if routing == "one_expert_all_tokens":
        assert int(plan.group_sizes[5]) == 256
    if routing == "empty_experts":
        assert int(jnp.sum(plan.group_sizes == 0)) >= E // 2
    w1, w2 = _weights()
    out, _ = _run(variant, x, plan)
    assert _rel_err(out, _reference_fn()(x, plan, w1, w2)) < 1e-2


@pytest.mark.parametrize("num_tokens", [1, 8, 32, 128, 1024, 4096])
@pytest.mark.parametrize("routing", ["random", "skewed", "empty_experts", "one_expert_all_tokens"])
def test_decode_meta_kernel_is_bitwise_the_reference(num_tokens, routing):
    """The compiled metadata kernel (`decode_meta.py`, Triton) against the jnp reference,
    every array bit for bit, on outputs poisoned first."""
    from pallas_moe.kernels.decode_meta import decode_meta

    _, plan = _case(num_tokens, seed=6, routing=routing)
    config = DecodeConfig.for_shape(D, N)
    for aggregation in ("fp32", "bf16_scores"):
        want = jax.jit(lambda p: decode_meta(p, config, D, aggregation, impl="jnp"))(plan)
        _poison(4 * (plan.capacity * 80 + 128 * 64 * 8))
        got = jax.jit(lambda p: decode_meta(p, config, D, aggregation, impl="kernel"))(plan)
        for name in ("counts", "expert", "row_start", "num_rows", "row_ids", "block_lo",
                     "block_count", "block_target", "offsets", "agg_row", "agg_score"):
            g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
            assert g.shape == w.shape and g.dtype == w.dtype, name
            assert np.array_equal(g.view(np.int32), w.view(np.int32)), (name, aggregation)



@pytest.mark.parametrize("num_tokens", [1, 8, 64, 128])
@pytest.mark.parametrize("routing", ["random", "skewed", "empty_experts", "one_expert_all_tokens"])
def test_forward_schedule_kernel_is_bitwise_the_reference(num_tokens, routing):
    """The compiled schedule kernel of the kernel-by-kernel forward
    (`schedules.forward_schedule_kernel`, Triton, `ForwardConfig.schedule_impl="kernel"`)
    against the jnp TileMetas (`_common.tile_meta`, `_common.aligned_tile_meta`), every
    array bit for bit, on outputs poisoned first: the config's block sizes through
    `forward_schedules`, then 64-, 192- and 256-row up tiles with 64- and 128-row aligned
    tiles."""
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.schedules import forward_schedule_kernel, forward_schedules

    _, plan = _case(num_tokens, seed=7, routing=routing)
    jnp_config = ForwardConfig.for_shape(D, N)
    kernel_config = dataclasses.replace(jnp_config, schedule_impl="kernel")
    pairs = [(jnp_config, kernel_config), (64, 64), (192, 128), (256, 128)]
    for a, b in pairs:
        if isinstance(a, ForwardConfig):
            want = jax.jit(lambda p: forward_schedules(p, a))(plan)
            _poison(4 * 8 * plan.capacity * 512)
            got = jax.jit(lambda p: forward_schedules(p, b))(plan)
        else:
            want = jax.jit(lambda p: (_common.tile_meta(p.group_sizes, p.token_ids, a),
                                      _common.aligned_tile_meta(p.group_sizes, p.capacity, b)))(plan)
            _poison(4 * 8 * plan.capacity * 512)
            got = jax.jit(lambda p: forward_schedule_kernel(p.group_sizes, p.token_ids, a, b))(plan)
        for kind, g_meta, w_meta in zip(("up", "down"), got, want):
            assert g_meta.block_m == w_meta.block_m
            for name in ("expert", "row_start", "num_rows", "row_ids"):
                g, w = np.asarray(getattr(g_meta, name)), np.asarray(getattr(w_meta, name))
                assert g.shape == w.shape and g.dtype == w.dtype, (kind, name)
                assert np.array_equal(g, w), (kind, name, w_meta.block_m)


@pytest.mark.parametrize("num_tokens", [8, 128])
def test_kernel_path_with_the_schedule_kernel_is_bitwise_the_default(num_tokens):
    """`pm.moe_ffn` through the kernel-by-kernel forward with its tile metadata from the
    schedule kernel (`ForwardConfig.schedule_impl="kernel"`): bitwise the default (jnp
    metadata) and close to the xla backend."""
    from pallas_moe.kernels import KernelConfig

    x, plan = _case(num_tokens, seed=8)
    w1, w2 = _weights()
    base = KernelConfig.for_shape(D, N)
    meta = dataclasses.replace(
        base, forward=dataclasses.replace(base.forward, schedule_impl="kernel"))
    outs = []
    for config in (base, meta):
        _poison((num_tokens * D + plan.capacity * (3 * N + 2 * D) + 256 * 64 * (N + D)) * 2)
        outs.append(jax.block_until_ready(jax.jit(
            lambda x, p, w1, w2, c=config: pm.moe_ffn(x, p, w1, w2, backend="mosaic", config=c)
        )(x, plan, w1, w2)))
    assert np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    assert _rel_err(outs[1], _reference_fn()(x, plan, w1, w2)) < 1e-2

@pytest.mark.parametrize("variant", ["static", "dynamic"])
def test_h_matches_the_kernel_path(variant):
    """With write_h the megakernel also writes H, as the op's backward needs it."""
    from pallas_moe.kernels.moe_forward import moe_forward

    x, plan = _case(128, seed=2)
    w1, w2 = _weights()
    _, h = _run(variant, x, plan, write_h=True)
    _, h_ref = jax.jit(moe_forward)(x, plan, w1, w2)
    rows = int(plan.num_rows)
    assert _rel_err(h[:rows], h_ref[:rows]) < 1e-2


@pytest.mark.parametrize("variant", ["static", "dynamic", "static_meta"])
def test_hundred_runs_no_hang_bitwise_equal(variant):
    x, plan = _case(64, seed=3)
    first, _ = _run(variant, x, plan)
    w1, w2 = _weights()
    f = _decode_fn(variant)
    for i in range(100):
        again, _ = f(x, plan, w1, w2)
        assert bool(jnp.array_equal(first, again)), f"run {i} differs from the first"


# The H200's limit (32) and one past it; T = 1 is the megakernel everywhere. (Session 26 ran
# T = 1, 2, 4, 8 and 16 with the megakernel; each case is ~50 s on the GPU.)
@pytest.mark.parametrize("num_tokens", [1, 32, 33])
def test_moe_ffn_default_at_the_smallest_batches_matches_xla_with_gradients(num_tokens):
    """`pm.moe_ffn(backend="mosaic")` with no config runs the megakernel forward (with H)
    up to `decode_max_tokens()` tokens and the kernel forward above, then the kernel
    backward: output and gradients against the xla backend, bitwise
    reproducible."""
    from pallas_moe.kernels.moe_forward import decode_max_tokens

    x, plan = _case(num_tokens, seed=4)
    w1, w2 = _weights()
    cot = jax.random.normal(jax.random.key(5), x.shape, jnp.float32)

    def step(backend):
        def loss(x, scores, w1, w2):
            out = pm.moe_ffn(x, plan.with_scores(scores), w1, w2, backend=backend)
            return jnp.sum(out.astype(jnp.float32) * cot), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    args = (x, plan.scores, w1, w2)
    megakernel = "moe_decode" in str(jax.make_jaxpr(step("mosaic"))(*args))
    assert megakernel == (num_tokens <= decode_max_tokens())
    _poison((x.shape[0] * D + plan.capacity * 4 * N + 128 * 64 * (N + D)) * 2)
    (_, out), grads = step("mosaic")(*args)
    (_, ref), ref_grads = step("xla")(*args)
    assert _rel_err(out, ref) < 1e-2
    for name, g, r in zip(["x", "scores", "w_gate_up", "w_down"], grads, ref_grads):
        assert _rel_err(g, r) < 2e-2, name
    (_, again), grads_again = step("mosaic")(*args)
    assert bool(jnp.array_equal(out, again))
    for g, h in zip(grads, grads_again):
        assert bool(jnp.array_equal(g, h))
