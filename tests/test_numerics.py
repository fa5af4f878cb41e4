"""Aggregation modes (`pm.Numerics`): each backend bitwise against an independent numpy
reference of the mode's rounding order; their backward; the other switches; determinism.

The reference (`aggregate_np`) walks each token's rows found from `token_ids` and
`group_sizes` (not the plan's CSR arrays), sorted by expert, in numpy float32 with explicit
bf16 roundings (ml_dtypes): every step is one IEEE operation, so the order is exactly the
one the mode's documentation states.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.cuda_target import h100_target
import pallas_moe as pm
from pallas_moe.kernels.aggregate import AggregateConfig, aggregate, token_blocks
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


def aggregate_np(y, plan, mode: str, fused_multiply_add: bool = False) -> np.ndarray:
    """float32 [T, d] holding the mode's result (bf16 values for the bf16 modes).

    `fused_multiply_add`: "fp32" adds each `s[r] * Y[r]` with one rounding (an FMA, as the
    GPU compiler contracts the kernel's multiply and add), computed exactly in float64 and
    rounded once to float32 (the product of two float32 is exact in float64)."""
    y = np.asarray(jnp.asarray(y, jnp.float32))
    scores = np.asarray(plan.scores, np.float32)
    out = np.zeros((plan.num_tokens, y.shape[1]), np.float32)
    for t, rows in enumerate(rows_of_tokens(plan)):
        acc = np.zeros(y.shape[1], np.float32)
        for r in rows:
            if mode == "fp32" and fused_multiply_add:
                acc = (acc.astype(np.float64) + y[r].astype(np.float64) * np.float64(scores[r])
                       ).astype(np.float32)
            elif mode == "fp32":
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


@pytest.mark.parametrize("mode", ["fp32", "bf16_per_expert"])
def test_aggregation_past_the_grid_limit_walks_more_tokens_per_cta(mode, monkeypatch):
    """Above MAX_GRID_Y token blocks (the CUDA grid's y limit, 65535) each CTA walks more
    tokens than configured, in a loop: the same bits. The limit is lowered here so that
    interpret mode reaches that path at a small plan (19 tokens, 3 CTAs of 7)."""
    import importlib

    aggregate_module = importlib.import_module("pallas_moe.kernels.aggregate")  # the module, not the function
    plan = PLANS["topk"]()
    y = random_rows(plan, 256)
    want = aggregate_np(y, plan, mode)
    monkeypatch.setattr(aggregate_module, "MAX_GRID_Y", 3)
    got = aggregate(
        y, plan.rows_by_token, plan.token_row_offsets, plan.scores, aggregation=mode,
        out_dtype=jnp.bfloat16, config=AggregateConfig(block_t=1, block_d=256, vec=2), interpret=True,
    )
    assert_bitwise(got, want, jnp.bfloat16)


def test_aggregation_of_262144_tokens_lowers_for_cuda():
    """An expert-parallel receiver's 262144 rows (T = 32768, K = 8 on two GPUs) at the
    default block_t = 4 need 65536 CTAs on the grid's y dimension, one past its limit: the
    kernel walks 5 tokens per CTA instead, and lowers for Hopper."""
    tokens, d = 262144, 4096
    y = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((tokens + 1,), jnp.int32)
    rows = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    scores = jax.ShapeDtypeStruct((tokens,), jnp.float32)
    with h100_target():
        text = jax.jit(functools.partial(aggregate, aggregation="fp32")).trace(
            y, rows, offsets, scores).lower(lowering_platforms=("cuda",)).as_text()
    assert "moe_aggregate" in text
    assert token_blocks(tokens, AggregateConfig().block_t) == (5, 52429)
    assert token_blocks(tokens - 4, AggregateConfig().block_t) == (4, 65535)  # the last that fits


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


# ---------------------------------------------------------------------------------------
# The whole op: every backend's output is the mode's sum of its own expert rows.

T, D, N, E = 40, 64, 64, 4


def layer_inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (T, D), jnp.bfloat16)
    w1 = (jax.random.normal(k[1], (E, D, 2 * N)) * D**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[2], (E, N, D)) * N**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(k[3], (T, D), jnp.bfloat16)
    return x, w1, w2, cot


def expert_rows(x, plan, w1, w2, backend):
    """Y [P, d] of the plan's rows through `moe_ffn` itself: each row is its own token with
    weight 1, so every mode returns Y exactly."""
    sel = plan.expert_ids[:, None] == jnp.arange(plan.num_experts)[None, :]  # [P, E]
    rows_plan = plan_from_assignment(sel, jnp.ones(sel.shape), sel, plan.capacity)
    return pm.moe_ffn(x[plan.token_ids], rows_plan, w1, w2, backend=backend)


@pytest.mark.parametrize(
    "backend, modes",
    [
        ("xla", AGGREGATIONS),
        ("interpret", ("bf16_per_expert",)),
        pytest.param("interpret", ("fp32", "bf16_scores"), marks=pytest.mark.slow),
    ],
)
def test_moe_ffn_output_is_the_mode_sum_of_its_expert_rows(backend, modes):
    x, w1, w2, _ = layer_inputs()
    plan = token_rounding_with_empty_token()
    y = expert_rows(x, plan, w1, w2, backend)
    for mode in modes:
        out = pm.moe_ffn(x, plan, w1, w2, backend=backend, numerics=Numerics(aggregation=mode))
        assert_bitwise(out, aggregate_np(y, plan, mode), jnp.bfloat16)


# ---------------------------------------------------------------------------------------
# Backward.


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_backward_is_straight_through(mode):
    """dL/dY[r] = s_eff[r] * g[t] (bitwise) and dL/ds[r] = <g[t], Y[r]> (fp32 accumulation)."""
    plan = PLANS["ragged"]()
    y = random_rows(plan, 256).astype(jnp.float32)
    g = jax.random.normal(jax.random.key(2), (plan.num_tokens, 256))

    def loss(y, s):
        return jnp.sum(aggregate_rows(y, plan.with_scores(s), mode, block_m=4) * g)

    dy, ds = jax.jit(jax.grad(loss, argnums=(0, 1)))(y, plan.scores)
    s = np.asarray(plan.scores, np.float32)
    s_eff = bf16(s) if mode == "bf16_scores" else s
    real = np.arange(plan.capacity) < int(plan.num_rows)
    tok = np.asarray(plan.token_ids)
    g_np, y_np = np.asarray(g), np.asarray(y)
    want_dy = np.where(real[:, None], s_eff[:, None] * g_np[tok], 0).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(dy), want_dy)
    want_ds = np.where(real, np.einsum("pd,pd->p", g_np[tok].astype(np.float64), y_np), 0)
    np.testing.assert_allclose(np.asarray(ds), want_ds, rtol=1e-5, atol=1e-5)


@functools.cache
def jitted_layer_grads(backend: str, mode: str):
    """Jitted `(x, w1, w2, cot, plan) -> (out, grads of <out, cot> w.r.t. x, w_gate_up,
    w_down, scores)`; cached, so calling it again runs the same executable."""

    def f(x, w1, w2, s, cot, plan):
        out = pm.moe_ffn(x, plan.with_scores(s), w1, w2, backend=backend,
                         numerics=Numerics(aggregation=mode))
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    grad = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)
    return jax.jit(lambda x, w1, w2, cot, plan: grad(x, w1, w2, plan.scores, cot, plan))


def layer_grads(backend, mode, plan, rounded_scores=False):
    """[out, dx, dw_gate_up, dw_down, d_scores] as numpy arrays."""
    x, w1, w2, cot = layer_inputs()
    if rounded_scores:
        plan = plan.with_scores(round_bf16(plan.scores))
    (_, out), grads = jitted_layer_grads(backend, mode)(x, w1, w2, cot, plan)
    return [np.asarray(a) for a in (out, *grads)]


def assert_all_equal(a, b, names=("out", "dx", "dw_gate_up", "dw_down", "d_scores")):
    for name, u, v in zip(names, a, b):
        np.testing.assert_array_equal(u, v, err_msg=name)


@pytest.mark.parametrize(
    "backend", ["xla", pytest.param("interpret", marks=pytest.mark.slow)]
)
def test_backward_of_each_mode(backend):
    """bf16_scores: the fp32 backward at bf16-rounded scores; bf16_per_expert: the fp32 one."""
    plan = token_rounding_with_empty_token()
    fp32 = layer_grads(backend, "fp32", plan)
    per_expert = layer_grads(backend, "bf16_per_expert", plan)
    assert_all_equal(per_expert[1:], fp32[1:], names=("dx", "dw_gate_up", "dw_down", "d_scores"))
    scores = layer_grads(backend, "bf16_scores", plan)
    fp32_rounded = layer_grads(backend, "fp32", plan, rounded_scores=True)
    assert_all_equal(scores[1:], fp32_rounded[1:], names=("dx", "dw_gate_up", "dw_down", "d_scores"))
    # ... and it is not the backward at the unrounded scores.
    assert np.any(scores[1] != fp32[1])


# ---------------------------------------------------------------------------------------
# Determinism: forward and every gradient bitwise from run to run, and after recompiling.


@pytest.mark.parametrize(
    "backend, modes",
    [
        ("xla", AGGREGATIONS),
        pytest.param("interpret", ("fp32", "bf16_per_expert"), marks=pytest.mark.slow),
    ],
)
# CI time: token rounding (a plan with padding rows and an empty token) runs the same
# backend and checks; top-K is a slow extra.
@pytest.mark.parametrize("router", [pytest.param("topk", marks=pytest.mark.slow),
                                    "token_rounding"])
def test_forward_and_gradients_bitwise_run_to_run(backend, modes, router):
    if router == "topk":
        plan = topk_plan(jax.random.normal(jax.random.key(5), (T, E)), 2)
    else:
        plan = token_rounding_with_empty_token()
    first = {mode: layer_grads(backend, mode, plan) for mode in modes}
    for mode in modes:  # the same executable again
        assert_all_equal(layer_grads(backend, mode, plan), first[mode])
    jax.clear_caches()
    jitted_layer_grads.cache_clear()
    mode = modes[-1]  # a fresh trace and compilation
    assert_all_equal(layer_grads(backend, mode, plan), first[mode])


# ---------------------------------------------------------------------------------------
# The other switches and the errors.


def test_numerics_validation():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        Numerics(aggregation="bf16")
    with pytest.raises(ValueError, match="router_dtype must be one of"):
        Numerics(router_dtype="float16")
    with pytest.raises(TypeError, match="fuse_swiglu must be a bool"):
        Numerics(fuse_swiglu=1)
    x, w1, w2, _ = layer_inputs()
    plan = topk_plan(jax.random.normal(jax.random.key(5), (T, E)), 2)
    with pytest.raises(TypeError, match="numerics must be a pallas_moe.Numerics"):
        pm.moe_ffn(x, plan, w1, w2, backend="xla", numerics="bf16_per_expert")
    f32 = lambda a: a.astype(jnp.float32)
    with pytest.raises(ValueError, match="needs bf16 activations"):
        pm.moe_ffn(f32(x), plan, f32(w1), f32(w2), backend="xla",
                   numerics=Numerics(aggregation="bf16_scores"))
    with pytest.raises(ValueError, match="scores=None"):
        aggregate(x[plan.token_ids], plan.rows_by_token, plan.token_row_offsets, None,
                  aggregation="bf16_per_expert", config=AggregateConfig(block_d=64, vec=1),
                  interpret=True)
    from flax import nnx

    with pytest.raises(ValueError, match="needs bf16 activations"):
        pm.nn.MoE(16, 8, 4, 2, rngs=nnx.Rngs(0), dtype=jnp.float32,
                  numerics=Numerics(aggregation="bf16_per_expert"))


@pytest.mark.slow
def test_unfused_swiglu_is_bitwise_the_fused_one_in_interpret_mode():
    # On CPU the epilogue's sigmoid and XLA's are the same code; on the GPU they may differ.
    x, w1, w2, _ = layer_inputs()
    plan = token_rounding_with_empty_token()
    fused = pm.moe_ffn(x, plan, w1, w2, backend="interpret")
    unfused = pm.moe_ffn(x, plan, w1, w2, backend="interpret", numerics=Numerics(fuse_swiglu=False))
    assert_bitwise(unfused, np.asarray(fused, np.float32), jnp.bfloat16)


def test_modes_and_unfused_swiglu_lower_for_cuda():
    x, w1, w2, _ = layer_inputs()
    plan = token_rounding_with_empty_token()
    for numerics in (Numerics(aggregation="bf16_per_expert"),
                     Numerics(aggregation="bf16_scores", fuse_swiglu=False)):
        f = lambda x, w1, w2, s, nm=numerics: jax.grad(
            lambda *a: jnp.sum(pm.moe_ffn(a[0], plan.with_scores(a[3]), a[1], a[2],
                                          backend="mosaic", numerics=nm).astype(jnp.float32)),
            argnums=(0, 1, 2, 3),
        )(x, w1, w2, s)
        with h100_target():  # the AOT target `backend="mosaic"`'s device check reads
            jax.jit(f).trace(x, w1, w2, plan.scores).lower(lowering_platforms=("cuda",))


def test_router_dtype_bfloat16_is_a_bf16_linear():
    from pallas_moe.nn.functional import router_logits

    x = jax.random.normal(jax.random.key(0), (33, 48))
    w = jax.random.normal(jax.random.key(1), (48, 6)) * 0.2
    got = np.asarray(router_logits(x, w, dtype="bfloat16"))
    assert np.array_equal(got, bf16(got))  # bf16 values
    exact = bf16(x).astype(np.float64) @ bf16(w).astype(np.float64)  # inputs rounded first
    # One bf16 rounding of the (fp32-accumulated) product: within half a bf16 ulp, plus a hair.
    np.testing.assert_allclose(got, exact, rtol=2**-8 + 1e-5, atol=1e-6)
    assert np.any(got != np.asarray(router_logits(x, w, dtype="float32")))


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_router_dtype_bfloat16_backward_is_a_bf16_linear_layers(x_dtype):
    """The bf16 router's gradients are a bf16 linear layer's (PyTorch autograd through
    `F.linear` on bf16 tensors): the logits' gradient rounded to bf16, then fp32-accumulated
    GEMMs of bf16 operands, each cast to its input's dtype. With x in fp32 the check is
    sharp (fp32 accumulation against float64): an unrounded gradient misses it by ~2^-9."""
    from pallas_moe.nn.functional import router_logits

    ks = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(ks[0], (40, 96)).astype(x_dtype)
    w = jax.random.normal(ks[1], (96, 8)) * 0.2  # an f32 parameter, as pm.nn.MoE keeps it
    ct = jax.random.normal(ks[2], (40, 8))  # f32, most values not representable in bf16
    logits, pullback = jax.vjp(lambda x, w: router_logits(x, w, dtype="bfloat16"), x, w)
    dx, dw = pullback(ct)
    assert dx.dtype == x_dtype and dw.dtype == jnp.float32 and logits.dtype == jnp.float32
    g = bf16(ct).astype(np.float64)
    dx_want = g @ bf16(w).astype(np.float64).T
    dw_want = bf16(x).astype(np.float64).T @ g
    np.testing.assert_allclose(np.asarray(dw), dw_want, rtol=1e-5, atol=1e-6)
    if x_dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(dx), dx_want, rtol=1e-5, atol=1e-6)
    else:  # one bf16 rounding of the fp32 product
        np.testing.assert_allclose(np.asarray(dx, np.float64), dx_want, rtol=2**-8 + 1e-5,
                                   atol=1e-6)


@pytest.mark.slow  # ~80 s: ten MoE compilations on an 8-device CPU mesh
def test_expert_parallel_bitwise_settings():
    """The README's claims: the ragged dispatch's forward and weight gradients are bitwise the
    single-device layer's in every mode; the all-gather dispatch's fp32 forward is not."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.numerics_ep_check"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 5, proc.stdout + proc.stderr[-4000:]
    for r in results:
        if r["dispatch"] == "emulated_ragged_all_to_all":
            assert r["bitwise_y"] and r["bitwise_weight_grads"], r
        else:
            assert not r["bitwise_y"] and r["y_rel"] < 2e-2, r
