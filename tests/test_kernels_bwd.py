"""Backward Mosaic GPU kernels (dH, dW2, dW1, dX~ and the `moe_backward` entry point).

Everything runs in Mosaic GPU interpret mode on CPU. Interpret mode fills every fresh GMEM
output (and SMEM) with NaN, so an element a kernel fails to write shows up as NaN: outputs
are poisoned on every call. Inputs are fresh random data per test; padding rows of the
contiguous inputs (H, dH, A') are poisoned with NaN/inf, so reading them fails the test.
Interpret mode is slow (each one-row TMA copy is a host callback), so the default set is
small; the per-kernel sweeps, race detection and the 30B lowering are `slow`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_moe as pm
from pallas_moe.kernels.dh import DHConfig, dh_kernel
from pallas_moe.kernels.dx import dx_rows
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig
from pallas_moe.kernels.moe_backward import BackwardConfig, dh_split_gemm_config, moe_backward
from pallas_moe.kernels.reference import moe_forward_reference, up_proj_reference
from pallas_moe.kernels.weight_grad import WeightGradConfig, weight_grad
from pallas_moe.ops.minimal_backward import dswiglu, moe_ffn_backward
from pallas_moe.ops.mosaic import minimal_residual_moe_ffn

BF16 = jnp.bfloat16
HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- problems


def make_plan(seed, num_tokens, num_experts, k, *, router="topk", skew=0.0, empty=(), tile=16):
    """A routing plan over random logits; `empty` experts get no rows, `skew` favours expert 0,
    router "all_to_one" sends every token to expert 0 (k must be 1)."""
    logits = jax.random.normal(jax.random.key(seed), (num_tokens, num_experts))
    logits = logits.at[:, 0].add(skew)
    for e in empty:
        logits = logits.at[:, e].set(-1e4)
    if router == "all_to_one":
        assert k == 1
        return pm.routing.topk_plan(logits.at[:, 0].set(1e4), 1)
    if router == "token_rounding":
        return pm.routing.token_rounding_plan(logits, k, tile=tile, rounding="up")
    return pm.routing.topk_plan(logits, k)


def make_problem(seed, num_tokens, d, n, num_experts, k, **plan_kw):
    """(x, h, plan, w_gate_up, w_down, grad_out), bf16, h = the forward's saved H with its
    padding rows poisoned with NaN."""
    plan = make_plan(seed, num_tokens, num_experts, k, **plan_kw)
    ks = jax.random.split(jax.random.key(seed + 1000), 4)
    x = jax.random.normal(ks[0], (num_tokens, d)).astype(BF16)
    w1 = (jax.random.normal(ks[1], (num_experts, d, 2 * n)) / np.sqrt(d)).astype(BF16)
    w2 = (jax.random.normal(ks[2], (num_experts, n, d)) / np.sqrt(n)).astype(BF16)
    grad_out = jax.random.normal(ks[3], (num_tokens, d)).astype(BF16)
    h, _ = up_proj_reference(x, plan.token_ids, plan.group_sizes, w1)
    h = jnp.where(plan.row_is_valid[:, None], h, jnp.nan).astype(BF16)
    return x, h, plan, w1, w2, grad_out


def rel_err(got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


def assert_close(got, ref, tol, name):
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all(), f"{name}: non-finite (unwritten?) elements"
    err = rel_err(got, ref)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


def interp(detect_races=False):
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def races_found() -> bool:
    # Private interpret-mode API: the race detector's verdict for the last detect_races run.
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    return bool(get_races().races_found)


def assert_untouched(got, start, stop=None):
    """Rows [start, stop) still hold interpret mode's NaN fill (the kernel must not own them)."""
    g = np.asarray(got[start:stop], np.float32)
    assert np.all(np.isnan(g)), "kernel wrote rows it does not own"


# ----------------------------------------------------------------------------- references


def assert_dh_outputs_equal(got, want, rows: int):
    """dh_kernel outputs (dH, A', dS) bitwise equal and finite: dH and A' on their first
    `rows` (the written) rows, dS everywhere."""
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if g.ndim == 2:
            g, w = g[:rows], w[:rows]
        assert np.all(np.isfinite(g)) and np.array_equal(g, w)


def dh_reference(grad_out, h, plan, w_down, activation=None):
    """(dh bf16 [P, 2n], a_scaled bf16 [P, n], d_scores f32 [P]) on the real rows; fp32 math.

    `activation`: a `SwiGLU` spec (None: the plain silu, written out independently)."""
    n = w_down.shape[1]
    valid = plan.row_is_valid
    expert = jnp.minimum(plan.expert_ids, w_down.shape[0] - 1)
    do = grad_out[plan.token_ids].astype(jnp.float32)
    da = jnp.einsum("pd,pnd->pn", do, w_down[expert].astype(jnp.float32), precision=HIGHEST)
    h = jnp.where(valid[:, None], h, 0).astype(h.dtype)
    if activation is None:
        a = jax.nn.silu(h[:, :n].astype(jnp.float32)) * h[:, n:].astype(jnp.float32)
        grad = dswiglu
    else:
        a, grad = activation(h), activation.grad
    s = plan.scores[:, None]
    d_scores = jnp.where(valid, jnp.sum(da * a, axis=-1), 0.0)
    return grad(h, s * da).astype(h.dtype), (s * a).astype(h.dtype), d_scores


def dh_kernel_order_reference(grad_out, h, plan, w_down, config: DHConfig, activation=None):
    """dh_kernel's outputs (dh bf16 [P_pad, 2n], a_scaled bf16 [P_pad, n], d_scores f32 [P])
    computed in interpret mode's order, to compare bitwise: per (row tile, column block) of
    `config.block_n` columns, dA' accumulates `np.matmul` of the gathered bf16 dO rows
    [block_m, 64] and the W2 tile [64, block_n] in f32 one 64-wide K step at a time (as
    interpret mode runs each wgmma: `acc + np.matmul(a, b, dtype=f32)`), then the kernel's
    own `dswiglu_epilogue` runs on the same [block_m, epilogue_cols] chunks, the dS partials
    of the chunks added in order and reduced by the kernel's `reduce_row_partials`. Rows
    past the real ones stay NaN, as in a poisoned output."""
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.dh import dswiglu_epilogue, reduce_row_partials, tile_scores

    activation = pm.ops.activation.SwiGLU() if activation is None else activation
    # Compiled, as the interpreted kernel compiles it: XLA's fused elementwise code rounds
    # a few elements of d gate differently from op-by-op execution (1 bf16 ulp, seen in
    # session 46 with 64-row chunks).
    jitted_epilogue = jax.jit(functools.partial(dswiglu_epilogue, activation=activation))
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    ep = config.epilogue_cols or bn
    num_experts, n, d = w_down.shape
    meta = _common.tile_meta(plan.group_sizes, plan.token_ids, bm)
    capacity = plan.token_ids.shape[0]
    rows_pad = -(-capacity // config.pad_rows_to) * config.pad_rows_to
    do, w, hh = np.asarray(grad_out), np.asarray(w_down), np.asarray(h)
    s_tiles = np.asarray(tile_scores(plan.scores, meta))  # [nt, bm] f32
    dh = np.full((rows_pad, 2 * n), np.nan, hh.dtype)
    a_scaled = np.full((rows_pad, n), np.nan, hh.dtype)
    partials = np.zeros((meta.num_tiles, n // bn, bm), np.float32)
    expert, start, num_rows, row_ids = (
        np.asarray(a) for a in (meta.expert, meta.row_start, meta.num_rows, meta.row_ids))
    for t in range(meta.num_tiles):
        rows = int(num_rows[t])
        if not rows:
            continue
        e, r0 = int(expert[t]), int(start[t])
        do_rows = do[row_ids[t]]  # [bm, d] bf16, gathered as the kernel gathers them
        s = jax.lax.broadcast_in_dim(jnp.asarray(s_tiles[t]), (bm, ep), [0])

        for j in range(n // bn):
            c0 = j * bn
            da = np.zeros((bm, bn), np.float32)
            for k0 in range(0, d, bk):
                da = da + np.matmul(do_rows[:, k0:k0 + bk], w[e, c0:c0 + bn, k0:k0 + bk].T,
                                    dtype=np.float32)
            gate, up = (np.zeros((bm, bn), hh.dtype) for _ in range(2))
            gate[:rows] = hh[r0:r0 + rows, c0:c0 + bn]
            up[:rows] = hh[r0:r0 + rows, n + c0:n + c0 + bn]
            ds = None
            for q in range(bn // ep):
                cs = slice(q * ep, (q + 1) * ep)
                d_gate, d_up, a_s, ds_q = jitted_epilogue(
                    jnp.asarray(da[:, cs]), jnp.asarray(gate[:, cs]).astype(jnp.float32),
                    jnp.asarray(up[:, cs]).astype(jnp.float32), s)
                ds = ds_q if ds is None else ds + ds_q
                out_rows = slice(r0, r0 + rows)
                dh[out_rows, c0 + q * ep:c0 + (q + 1) * ep] = np.asarray(d_gate.astype(BF16))[:rows]
                dh[out_rows, n + c0 + q * ep:n + c0 + (q + 1) * ep] = (
                    np.asarray(d_up.astype(BF16))[:rows])
                a_scaled[out_rows, c0 + q * ep:c0 + (q + 1) * ep] = (
                    np.asarray(a_s.astype(BF16))[:rows])
            partials[t, j] = np.asarray(ds)
    return dh, a_scaled, reduce_row_partials(jnp.asarray(partials), meta, capacity)


def check_dh(got, grad_out, h, plan, w_down, config: DHConfig, activation=None):
    """dh_kernel outputs `got` (under `config`): bitwise equal to the kernel-order reference,
    close to the f32 reference (dH and A' 1e-2, dS 1e-4), dS 0 past the real rows, and the
    padding rows of dH and A' unwritten (still interpret mode's NaN)."""
    rows = int(plan.num_rows)
    assert_dh_outputs_equal(
        got, dh_kernel_order_reference(grad_out, h, plan, w_down, config, activation), rows)
    ref_dh, ref_a, ref_ds = dh_reference(grad_out, h, plan, w_down, activation)
    assert_close(got[0][:rows], ref_dh[:rows], 1e-2, "dh")
    assert_close(got[1][:rows], ref_a[:rows], 1e-2, "a_scaled")
    assert_close(got[2], ref_ds, 1e-4, "d_scores")
    assert not np.any(np.asarray(got[2])[rows:])
    assert_untouched(got[0], rows)
    assert_untouched(got[1], rows)


def weight_grad_reference(lhs_rows, rhs_rows, plan):
    """out[e] = sum over e's rows r of lhs_rows[r]^T rhs_rows[r] (fp32), [E, M, N]."""
    onehot = jax.nn.one_hot(plan.expert_ids, plan.num_experts, dtype=jnp.float32)  # padding: 0
    return jnp.einsum(
        "pe,pm,pn->emn", onehot, lhs_rows.astype(jnp.float32), rhs_rows.astype(jnp.float32),
        precision=HIGHEST,
    )


def real_rows(a, plan):
    """Rows of `a` past the real ones set to 0 (for references of row-indexed operands)."""
    rows = a[: plan.capacity]
    return jnp.where(plan.row_is_valid[:, None], rows, 0).astype(a.dtype)


def padded_random(key, plan, cols, rows_to=64):
    """bf16 [P rounded up to rows_to, cols] random rows, NaN past the real rows."""
    rows = -(-plan.capacity // rows_to) * rows_to
    a = jax.random.normal(key, (rows, cols)).astype(BF16)
    valid = jnp.arange(rows) < plan.num_rows
    return jnp.where(valid[:, None], a, jnp.nan).astype(BF16)


# ----------------------------------------------------------------------------- entry point


def check_backward(problem, config=None, tol=1e-2):
    x, h, plan, w1, w2, grad_out = problem
    got = moe_backward(x, h, plan, w1, w2, grad_out, interpret=True, config=config)
    ref = moe_ffn_backward(x, h, plan, w1, w2, grad_out)
    names = ("dx", "d_scores", "dw_gate_up", "dw_down")
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, g.dtype, r.dtype)
        assert_close(g, r, tol, name)
    d_scores = np.asarray(got[1])
    assert not np.any(d_scores[int(plan.num_rows):]), "d_scores must be 0 on padding rows"
    sizes = np.asarray(plan.group_sizes)
    for e in np.flatnonzero(sizes == 0):  # empty experts: exact zeros, written
        assert not np.any(np.asarray(got[2][e], np.float32)), f"dw_gate_up[{e}] not zero"
        assert not np.any(np.asarray(got[3][e], np.float32)), f"dw_down[{e}] not zero"
    return got


def assert_plan_schedules_give_the_same_gradients(problem, config, got, dh_rows: int):
    """The backward again under `config`, with the tile metadata `plan_schedules` computes
    for it (whose dH tiles must have `dh_rows` rows), writes `got` bit for bit."""
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.schedules import plan_schedules

    x, h, plan, w1, w2, grad_out = problem
    _, n, d = w2.shape
    schedules = plan_schedules(plan, ForwardConfig.for_shape(d, n, num_sms=2), config)
    assert schedules.dh.block_m == dh_rows
    again = moe_backward(x, h, plan, w1, w2, grad_out, interpret=True, config=config,
                         schedules=schedules)
    for g, a in zip(got, again):
        assert bool(jnp.array_equal(g, a))


def test_backward_token_rounding_with_padding_and_empty_expert():
    # Token rounding pads rows (P_max = T*K + E*tile); expert 2 gets no rows; T*K is not a
    # multiple of any block, so every tile and K-block edge is ragged.
    problem = make_problem(0, 37, 128, 64, 4, 2, router="token_rounding", empty=(2,))
    plan = problem[2]
    assert int(plan.num_rows) < plan.capacity and int(plan.group_sizes[2]) == 0
    check_backward(problem)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        dict(num_tokens=48, num_experts=4, k=2),  # plain top-K
        dict(num_tokens=40, num_experts=1, k=1),  # E=1, K=1
        dict(num_tokens=70, num_experts=3, k=1, router="all_to_one"),  # one expert holds all
        dict(num_tokens=64, num_experts=6, k=2, skew=6.0),  # skewed routing
        dict(num_tokens=33, num_experts=5, k=2, empty=(0, 4)),  # first and last expert empty
    ],
    ids=["topk", "e1k1", "all_to_one", "skew", "empty_ends"],
)
def test_backward_plans(case):
    case = dict(case)
    check_backward(make_problem(1, case.pop("num_tokens"), 128, 64, case.pop("num_experts"),
                                case.pop("k"), **case))


@pytest.mark.slow
@pytest.mark.parametrize("consumers", [1, 2], ids=["one_consumer", "two_consumers"])
def test_backward_kernel_variants(consumers):
    # n = 256 and d = 256: every kernel with 1 or 2 consumer warpgroups.
    problem = make_problem(12, 30, 256, 256, 3, 2, router="token_rounding")
    base = BackwardConfig.for_shape(256, 256)
    cfg = BackwardConfig(
        dh=DHConfig(block_n=128 if consumers == 2 else 64, num_stages=4,
                    num_consumers=consumers, persistent_ctas=3),
        dw_down=WeightGradConfig(block_m=64, block_n=128, num_stages=3, num_consumers=consumers),
        dw_gate_up=WeightGradConfig(block_m=128, block_n=64, num_stages=3,
                                    num_consumers=consumers),
        dx=GroupedMatmulConfig(block_n=128, num_sms=3), aggregate=base.aggregate,
    )
    check_backward(problem, config=cfg)


@pytest.mark.slow
def test_backward_wide_blocks():
    # d = 192 and n = 192: 3-chunk gathered tiles (block 192) and block_n = 64 everywhere.
    problem = make_problem(2, 24, 192, 192, 3, 2)
    cfg = BackwardConfig.for_shape(192, 192)
    cfg = BackwardConfig(
        dh=cfg.dh, dx=GroupedMatmulConfig(block_n=192, num_stages=3, num_sms=3),
        aggregate=cfg.aggregate,
        dw_down=WeightGradConfig(block_m=64, block_n=192, block_k=64, num_stages=2),
        dw_gate_up=WeightGradConfig(block_m=192, block_n=128, block_k=64, num_stages=3),
    )
    check_backward(problem, config=cfg)


@pytest.mark.slow  # CI time: the same VJP and checks run in test_moe_ffn_kernels' test_interpret_backend_forward_and_gradients_match_xla[topk]
def test_custom_vjp_gradients_through_kernels():
    """Gradients of a loss through `minimal_residual_moe_ffn` with the kernel backward (and
    the jnp reference forward, so only the backward is under test here), vs plain autodiff of
    the xla backend, router logits included."""
    moe = minimal_residual_moe_ffn(
        moe_forward_reference, functools.partial(moe_backward, interpret=True)
    )
    xla = lambda x, plan, w1, w2: pm.moe_ffn(x, plan, w1, w2, backend="xla")

    num_tokens, d, n, num_experts = 20, 64, 64, 3
    ks = jax.random.split(jax.random.key(3), 5)
    logits = jax.random.normal(ks[0], (num_tokens, num_experts))
    x = jax.random.normal(ks[1], (num_tokens, d)).astype(BF16)
    w1 = (jax.random.normal(ks[2], (num_experts, d, 2 * n)) / np.sqrt(d)).astype(BF16)
    w2 = (jax.random.normal(ks[3], (num_experts, n, d)) / np.sqrt(n)).astype(BF16)
    cot = jax.random.normal(ks[4], (num_tokens, d))

    def grads(f):
        def loss(logits, x, w1, w2):
            plan = pm.routing.topk_plan(logits, 2)
            return jnp.sum(f(x, plan, w1, w2).astype(jnp.float32) * cot)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(logits, x, w1, w2)

    for name, g, r in zip(("logits", "x", "w_gate_up", "w_down"), grads(moe), grads(xla)):
        assert_close(g, r, 2e-2, name)


# ----------------------------------------------------------------------------- dH


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan_kw",
    [dict(), dict(router="token_rounding"), dict(empty=(1,), skew=4.0)],
    ids=["topk", "token_rounding", "skew_empty"],
)
def test_dh_kernel(plan_kw):
    """Two CTAs over 2 column blocks of every tile (n = 128, block_n = 64)."""
    x, h, plan, w1, w2, grad_out = make_problem(4, 45, 128, 128, 4, 2, **plan_kw)
    config = DHConfig(block_n=64, persistent_ctas=2)
    got = dh_kernel(grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2,
                    config=config, interpret=True)
    assert got[0].shape[0] % 64 == 0 and got[0].shape[0] >= plan.capacity
    check_dh(got, grad_out, h, plan, w2, config)


def test_dh_kernel_order_reference_can_fail():
    """The bitwise oracle is not vacuous: one flipped bit of one element of dH, A' or dS
    fails `assert_dh_outputs_equal`."""
    x, h, plan, w1, w2, grad_out = make_problem(4, 20, 64, 64, 2, 1)
    config = DHConfig(block_n=64)
    want = dh_kernel_order_reference(grad_out, h, plan, w2, config)
    rows = int(plan.num_rows)
    assert_dh_outputs_equal(want, want, rows)
    for i in range(3):
        got = list(want)
        bits = np.asarray(got[i]).copy().view(np.uint16 if i < 2 else np.uint32)
        if bits.ndim == 2:
            bits[rows - 1, 5] ^= 1
        else:
            bits[rows - 1] ^= 1
        got[i] = bits.view(np.asarray(got[i]).dtype)
        with pytest.raises(AssertionError):
            assert_dh_outputs_equal(got, want, rows)


# CI time (an opt-in extra): the clamped dH runs through moe_backward against XLA
# (test_moe_ffn_kernels' biases-and-clamped test), dH's races in test_dh_kernel_no_races
@pytest.mark.slow
def test_dh_kernel_clamped_swiglu_no_races():
    """gpt-oss's clamped SwiGLU in the dH epilogue: zero gradient where a clamp is active,
    as `SwiGLU.grad` (the `xla` backend's); H from an up-proj with an expert bias."""
    act = pm.ops.activation.SwiGLU.clamped(alpha=1.702, limit=0.75)
    x, _, plan, w1, w2, grad_out = make_problem(6, 20, 256, 128, 3, 2)
    b1 = (0.5 * jax.random.normal(jax.random.key(61), (3, 256))).astype(BF16)
    h, _ = up_proj_reference(x, plan.token_ids, plan.group_sizes, w1, b1, act)
    h = jnp.where(plan.row_is_valid[:, None], h, jnp.nan).astype(BF16)
    config = DHConfig(block_n=64, num_stages=4, num_consumers=2, persistent_ctas=2)
    dh, a_scaled, d_scores = dh_kernel(
        grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2,
        config=config, activation=act, interpret=interp(detect_races=True),
    )
    assert not races_found()
    rows = int(plan.num_rows)
    hv = np.asarray(h[:rows], np.float32)
    clamped = np.concatenate([hv[:, :128] > 0.75, np.abs(hv[:, 128:]) > 0.75], axis=1)
    assert clamped[:, :128].mean() > 0.1 and clamped[:, 128:].mean() > 0.2
    assert not np.any(np.asarray(dh[:rows], np.float32)[clamped]), "clamped elements pass no gradient"
    check_dh((dh, a_scaled, d_scores), grad_out, h, plan, w2, config, act)


# ----------------------------------------------------------------------------- dW


def _wgrad_case(seed, gathered, plan, m_dim, n_dim, config, interpret=True):
    ks = jax.random.split(jax.random.key(seed), 2)
    num_tokens = plan.num_tokens
    if gathered == "lhs":  # dW1 = X[tok]^T dH
        lhs = jax.random.normal(ks[0], (num_tokens, m_dim)).astype(BF16)
        rhs = padded_random(ks[1], plan, n_dim, config.block_k)
        ref = weight_grad_reference(lhs[plan.token_ids], real_rows(rhs, plan), plan)
    else:  # dW2 = A'^T dO[tok]
        lhs = padded_random(ks[0], plan, m_dim, config.block_k)
        rhs = jax.random.normal(ks[1], (num_tokens, n_dim)).astype(BF16)
        ref = weight_grad_reference(real_rows(lhs, plan), rhs[plan.token_ids], plan)
    got = weight_grad(
        lhs, rhs, plan.token_ids, plan.group_sizes, gathered=gathered, out_dtype=BF16,
        config=config, interpret=interpret,
    )
    assert got.shape == ref.shape and got.dtype == BF16
    assert_close(got, ref, 1e-2, f"weight_grad[{gathered}]")
    for e in np.flatnonzero(np.asarray(plan.group_sizes) == 0):
        assert not np.any(np.asarray(got[e], np.float32)), f"expert {e} must be exactly 0"
    return got


@pytest.mark.slow
@pytest.mark.parametrize("gathered", ["lhs", "rhs"])
@pytest.mark.parametrize(
    "plan_kw",
    [dict(num_tokens=50, k=2), dict(num_tokens=40, k=2, router="token_rounding", empty=(0,)),
     dict(num_tokens=70, k=1, router="all_to_one")],
    ids=["topk", "token_rounding_empty", "all_to_one"],
)
def test_weight_grad(gathered, plan_kw):
    plan_kw = dict(plan_kw)
    plan = make_plan(6, plan_kw.pop("num_tokens"), 4, plan_kw.pop("k"), **plan_kw)
    config = WeightGradConfig(block_m=128 if gathered == "lhs" else 64, block_n=128, num_stages=3)
    _wgrad_case(7, gathered, plan, 128, 128, config)


@pytest.mark.slow
@pytest.mark.parametrize("consumers", [1, 2], ids=["one_consumer", "two_consumers"])
@pytest.mark.parametrize("gathered", ["lhs", "rhs"])
def test_weight_grad_detect_races(gathered, consumers):
    # 220 rows in one expert: 5 K-blocks with 2 stages, so the token-id ring is refilled
    # (ki + stages < num_k) and slots are reused; the other two experts are empty.
    plan = make_plan(8, 220, 3, 1, router="all_to_one")
    config = WeightGradConfig(block_m=64, block_n=64, num_stages=2, num_consumers=consumers)
    _wgrad_case(9, gathered, plan, 128, 128, config, interpret=interp(detect_races=True))
    assert not races_found()


# CI time (an opt-in extra): the persistent walks run race-checked against the reference in
# test_persistent_weight_grad_detect_races; their bitwise equality to one CTA per item is
# this slow extra and a GPU test (test_weight_grad_persistent_equals_one_cta_per_item, 8 of 8
# passed on the H100 in session 45).
@pytest.mark.slow
@pytest.mark.parametrize("gathered", ["lhs", "rhs"])
@pytest.mark.parametrize(
    "plan_kw, ctas",
    [(dict(num_tokens=90, k=2, empty=(2,), skew=3.0), 3),
     pytest.param(dict(num_tokens=72, k=2, router="token_rounding", skew=3.0), 2,
                  marks=pytest.mark.slow)],
    ids=["topk_empty", "token_rounding_skewed"],
)
def test_persistent_weight_grad_equals_one_cta_per_item(gathered, plan_kw, ctas):
    """Persistent CTAs walk several (expert, tile) items each, experts of different K-block
    counts and an empty one among them, so the producer's global steps, its token-id
    look-ahead across items and the consumers' separate output tiles are all exercised.
    Same products in the same order as one CTA per item: bitwise equal, and both match the
    reference (`_wgrad_case`)."""
    plan_kw = dict(plan_kw)
    plan = make_plan(21, plan_kw.pop("num_tokens"), 5, plan_kw.pop("k"), **plan_kw)
    assert int(np.max(np.asarray(plan.group_sizes))) > 64  # an expert of several K-blocks
    base = WeightGradConfig(block_m=64, block_n=64, num_stages=2, num_consumers=2)
    one = _wgrad_case(22, gathered, plan, 128, 128, base)
    many = _wgrad_case(22, gathered, plan, 128, 128,
                       dataclasses.replace(base, persistent_ctas=ctas))
    np.testing.assert_array_equal(np.asarray(many, np.float32), np.asarray(one, np.float32))


@pytest.mark.parametrize("gathered, output_chunks", [
    ("rhs", 0), ("lhs", 1),
    # CI time: dW2's chunks are column blocks, the same buffer walk as dW1's row blocks; the
    # whole-tile buffers (output_chunks=0) run raced in [rhs-0].
    pytest.param("lhs", 0, marks=pytest.mark.slow),
    pytest.param("rhs", 1, marks=pytest.mark.slow)])
def test_persistent_weight_grad_detect_races(gathered, output_chunks):
    """Two persistent CTAs over 3 experts x 4 tiles (experts of 2 and 3 K-blocks that share
    one block, and an empty one): a 2-slot ring reused across items, and output tiles
    rewritten while the previous item's stores may still read them. With
    `output_chunks=1` a consumer's two output chunks (block 128 on the gathered side) take
    turns in one buffer, each rewritten while the other's store may still read it."""
    plan = make_plan(23, 120, 3, 2, empty=(1,))
    wide = dict(block_m=128) if gathered == "lhs" else dict(block_n=128)
    config = WeightGradConfig(**{"block_m": 64, "block_n": 64, **(wide if output_chunks else {})},
                              num_stages=2, num_consumers=1, persistent_ctas=2,
                              output_chunks=output_chunks)
    _wgrad_case(24, gathered, plan, 128, 128, config, interpret=interp(detect_races=True))
    assert not races_found()


@pytest.mark.parametrize("gathered", ["lhs", pytest.param("rhs", marks=pytest.mark.slow)])
def test_persistent_weight_grad_192_wide_chunks_detect_races(gathered):
    """The 7B default's tile (session 64): 192-wide gathered chunks beside 128-wide tiles
    with 3 stages, two persistent CTAs over 3 experts (one empty) and two tiles, three
    64-wide output chunks taking turns in one buffer per consumer: race-free and equal to
    the f32 reference. (CI time: dW2's chunks are column blocks, the same buffer walk as
    dW1's row blocks, so "rhs" is an opt-in extra.)"""
    plan = make_plan(23, 100, 3, 2, empty=(1,))
    tiles = dict(block_m=192, block_n=128) if gathered == "lhs" else dict(block_m=128,
                                                                         block_n=192)
    config = WeightGradConfig(**tiles, num_stages=3, num_consumers=2, persistent_ctas=2,
                              output_chunks=1)
    dims = (192, 256) if gathered == "lhs" else (256, 192)
    _wgrad_case(25, gathered, plan, *dims, config, interpret=interp(detect_races=True))
    assert not races_found()


def _wgrad_race_free_and_bitwise(seed, gathered, plan, dims, config, other):
    """`_wgrad_case` under `config` with the race detector (no races), then under `other`
    (no detector): both close to the reference and bitwise equal."""
    got = _wgrad_case(seed, gathered, plan, *dims, config, interpret=interp(detect_races=True))
    assert not races_found()
    want = _wgrad_case(seed, gathered, plan, *dims, other)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("gathered", ["rhs", "lhs"])
def test_weight_grad_three_consumers_no_races(gathered):
    """Three consumer warpgroups splitting the contiguous side (dW2: 3 x 64 output rows,
    dW1: 3 x 64 output columns; the default at gpt-oss's widths since session 49), two
    persistent CTAs on a 2-slot ring, an empty expert: race-free, equal to the f32
    reference with the empty expert exactly 0, and bitwise what one consumer writes (each
    output element is one consumer's K loop either way)."""
    plan = make_plan(23, 120, 3, 2, empty=(1,))
    config = WeightGradConfig(block_m=64, block_n=64, num_stages=2, num_consumers=3,
                              persistent_ctas=2)
    dims = (192, 128) if gathered == "rhs" else (128, 192)
    _wgrad_race_free_and_bitwise(24, gathered, plan, dims, config,
                                 dataclasses.replace(config, num_consumers=1))


def test_weight_grad_config_errors():
    plan = make_plan(25, 16, 2, 1)
    x = jnp.zeros((16, 128), BF16)
    dh = jnp.zeros((64, 256), BF16)
    call = functools.partial(weight_grad, x, dh, plan.token_ids, plan.group_sizes,
                             gathered="lhs", out_dtype=BF16)
    with pytest.raises(ValueError, match="persistent_ctas=-1"):
        call(config=WeightGradConfig(persistent_ctas=-1))
    # 4 stages of 48 KB plus 64 KB of output tiles: more SMEM than a CTA has.
    wide4 = WeightGradConfig(block_m=128, block_n=128, num_stages=4, num_consumers=2,
                             persistent_ctas=132)
    with pytest.raises(ValueError, match="lower config.num_stages or config.output_chunks"):
        call(config=wide4)
    for bad in (dict(persistent_ctas=0, output_chunks=1), dict(output_chunks=3),
                dict(output_chunks=-1)):
        with pytest.raises(ValueError, match="output_chunks=-?[13] needs persistent_ctas > 0 "
                                             "and must divide the 2 output chunks"):
            call(config=dataclasses.replace(wide4, **bad))
    # `cluster_m` and `expert_major` (removed in session 63: no faster than the default on
    # the H100) and `wgmma_lag` (session 64) are a TypeError, not ignored; the lagged
    # cp.async publish ("wait_group", removed in session 63) a ValueError naming the field.
    for removed in (dict(cluster_m=2), dict(expert_major=False), dict(wgmma_lag=0)):
        with pytest.raises(TypeError, match=next(iter(removed))):
            WeightGradConfig(**removed)
    with pytest.raises(ValueError, match="config.gather_completion='wait_group'"):
        WeightGradConfig(gather="cp_async", gather_completion="wait_group")
    with pytest.raises(ValueError, match="config.gather_completion='wait_group'"):
        dataclasses.replace(wide4, gather_completion="wait_group")


def _lower_weight_grad_for_cuda(shape, gathered, config):
    """Lowers `weight_grad` for cuda at `shape` (T, d, n, E, K): dW1 (`gathered="lhs"`) or
    dW2 under `config`."""
    t, d, n, e, k = shape
    p = t * k
    sds = jax.ShapeDtypeStruct
    lhs, rhs = ((sds((t, d), BF16), sds((p, 2 * n), BF16)) if gathered == "lhs"
                else (sds((p, n), BF16), sds((t, d), BF16)))
    f = functools.partial(weight_grad, gathered=gathered, out_dtype=BF16, config=config)
    jax.jit(f).trace(lhs, rhs, sds((p,), jnp.int32), sds((e,), jnp.int32)).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("gathered", ["lhs", "rhs"])
@pytest.mark.parametrize("shape", [(24576, 1536, 256, 128, 8), (32768, 4096, 512, 128, 8),
                                   (16384, 2048, 768, 128, 8), (8192, 2880, 1408, 32, 4),
                                   (8192, 7168, 2048, 16, 2), (8192, 2880, 2880, 32, 4)],
                         ids=["7b", "30b", "qwen3", "w2880", "w7168", "gpt_oss_20b"])
def test_persistent_weight_grads_lower_for_cuda(shape, gathered):
    """Every card's default weight gradients (`BackwardConfig.for_shape`; the H100's since
    session 44, the H200's since session 25) are persistent CTAs beside one output buffer
    per consumer (`output_chunks=1`), and they fit a CTA's SMEM (Mosaic checks the exact
    bytes when it lowers) at the 7B (192-wide gathered chunks with 3 stages beside 128-wide
    tiles, session 64), 30B, Qwen3, d = 2880 (192-wide gathered chunks: three output chunks
    take turns in one buffer), d = 7168 and gpt-oss-20b (d = n = 2880: dW2 with one
    consumer) widths; 4 stages everywhere but 7B."""
    _, d, n, _, _ = shape
    gathered_width, stages = (192, 3) if d == 1536 else (192 if d % 128 else 128, 4)
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", ""):
        cfg = BackwardConfig.for_shape(d, n, device_kind=kind, num_sms=132)
        config = cfg.dw_gate_up if gathered == "lhs" else cfg.dw_down
        width = config.block_m if gathered == "lhs" else config.block_n
        got = (config.persistent_ctas, config.num_stages, config.output_chunks, width)
        assert got == (132, stages, 1, gathered_width), kind
    _lower_weight_grad_for_cuda(shape, gathered, config)


# The widths and CTA counts of the GPU test `test_gpu.py::
# test_weight_grad_persistent_equals_one_cta_per_item` (T, d, n, E, K), shared with it.
PERSISTENT_WEIGHT_GRAD_GPU_CASES = {
    "7b_widths": ((6000, 1536, 256, 32, 8), 132),
    "30b_widths": ((3000, 4096, 512, 16, 4), 132),
    "qwen3_widths_7_ctas": ((4000, 2048, 768, 32, 8), 7),
    "w2880_widths": ((3000, 2880, 1408, 16, 4), 132),
    "gpt_oss_widths": ((3000, 2880, 2880, 16, 4), 132),
}


def persistent_weight_grad_forms(d: int, n: int, num_ctas: int, gathered: str) -> list:
    """The weight-gradient configs the GPU test compares bit for bit, at widths (d, n) with
    `num_ctas` CTAs: one CTA per item, persistent CTAs with separate output buffers per
    consumer (3 stages, the cp.async gather's fewest; where those do not fit beside 7B's
    192-wide gathered chunks, 271104 B, the previous default instead: 128-wide chunks with
    4 stages; the chunk width splits the output, not the K order), the default (one output
    buffer per consumer, `output_chunks=1`), and at gpt-oss's widths (three consumers) the
    consumer count before (dW2 one, dW1 two)."""
    from pallas_moe.kernels.weight_grad import PERSISTENT_SMEM_BUDGET, persistent_smem_bytes

    default = BackwardConfig.for_shape(d, n, num_sms=num_ctas)
    fast = default.dw_gate_up if gathered == "lhs" else default.dw_down
    base = dataclasses.replace(fast, persistent_ctas=0, output_chunks=0)  # one per item
    separate = dataclasses.replace(base, num_stages=3, persistent_ctas=num_ctas)
    if persistent_smem_bytes(separate, gathered, 2) > PERSISTENT_SMEM_BUDGET:
        chunk = "block_m" if gathered == "lhs" else "block_n"
        separate = dataclasses.replace(fast, num_stages=4, **{chunk: 128})
    fewer_consumers = ([dataclasses.replace(fast, num_consumers=1 if gathered == "rhs" else 2)]
                       if fast.num_consumers == 3 else [])
    return [base, separate, fast, *fewer_consumers]


@pytest.mark.parametrize("gathered", ["lhs", "rhs"])
@pytest.mark.parametrize("case", list(PERSISTENT_WEIGHT_GRAD_GPU_CASES))
def test_persistent_weight_grad_gpu_test_forms_trace_for_cuda(case, gathered):
    """Every config the GPU test of the persistent weight gradients builds passes the
    kernel's checks (SMEM, stages) at that test's widths: traced for cuda, ~0.1 s each.
    Session 66 lost a GPU test to a form that could not fit beside a new default's
    192-wide chunks; a trace on the CPU raises the same ValueError."""
    (t, d, n, e, k), num_ctas = PERSISTENT_WEIGHT_GRAD_GPU_CASES[case]
    forms = persistent_weight_grad_forms(d, n, num_ctas, gathered)
    assert forms[2].persistent_ctas == num_ctas and forms[2].output_chunks == 1, forms[2]
    p = t * k
    sds = jax.ShapeDtypeStruct
    lhs, rhs = ((sds((t, d), BF16), sds((p + 256, 2 * n), BF16)) if gathered == "lhs"
                else (sds((p + 256, n), BF16), sds((t, d), BF16)))
    from tests.cuda_target import h100_target

    for config in forms:
        f = functools.partial(weight_grad, gathered=gathered, out_dtype=BF16, config=config)
        with h100_target():
            jax.jit(f).trace(lhs, rhs, sds((p,), jnp.int32), sds((e,), jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(24576, 1536, 256, 128, 8), (32768, 4096, 512, 128, 8)],
                         ids=["7b", "30b"])
def test_persistent_sweep_weight_grads_lower_for_cuda(shape):
    """Every weight-gradient candidate of `backward.py --sweep persistent` (session 63: other
    persistent tiles, kept where `persistent_smem_bytes` says they fit) lowers for cuda at
    production sizes, so a GPU run of the sweep times each instead of failing to compile."""
    from benchmarks.backward import configs_for

    _, d, n, _, _ = shape
    base, _, dw2, dw1, _ = configs_for(d, n, "persistent")
    assert dw2[0] == base.dw_down and dw1[0] == base.dw_gate_up
    assert len(dw2) >= 5 and len(dw1) >= 5  # the default and its alternatives
    for gathered, cfgs in (("rhs", dw2), ("lhs", dw1)):
        for config in cfgs:
            assert config.persistent_ctas > 0, config
            _lower_weight_grad_for_cuda(shape, gathered, config)


@pytest.mark.parametrize("shape", [
    pytest.param((24576, 1536, 256, 128, 8), marks=pytest.mark.slow),  # CI time: gpt-oss's
    pytest.param((32768, 4096, 512, 128, 8), marks=pytest.mark.slow),
    (8192, 2880, 2880, 32, 4),  # fused dH default, three consumers everywhere
], ids=["7b", "30b", "gpt_oss"])
def test_registers_sweep_lowers_for_cuda(shape):
    """Every candidate of `backward.py --sweep registers` (the even register split,
    `rebalance_registers=False`, of the fused dH where it is the default, and of both weight
    gradients) lowers for cuda at the benchmark's widths, without setmaxnreg; where dH is
    split (30B) the sweep adds no dH candidate."""
    from benchmarks.backward import configs_for
    from tests.cuda_target import h100_target

    _, d, n, e, k = shape
    t = 512  # lowering cost does not depend on T
    p = t * k
    sds = jax.ShapeDtypeStruct
    with h100_target():
        base, dh, dw2, dw1, _ = configs_for(d, n, "registers")
        split = base.dh_gemm is not None
        assert split == (d == 4096), base
        assert dh == ([base.dh] if split
                      else [base.dh, dataclasses.replace(base.dh, rebalance_registers=False)])
        assert dw2 == [base.dw_down, dataclasses.replace(base.dw_down, rebalance_registers=False)]
        assert dw1 == [base.dw_gate_up,
                       dataclasses.replace(base.dw_gate_up, rebalance_registers=False)]
        lowered = [(c, jax.jit(functools.partial(dh_kernel, config=c)).trace(
            sds((t, d), BF16), sds((p, 2 * n), BF16), sds((p,), jnp.int32), sds((e,), jnp.int32),
            sds((p,), jnp.float32), sds((e, n, d), BF16)).lower(lowering_platforms=("cuda",)))
            for c in dh[1:]]
        for gathered, cfgs in (("rhs", dw2), ("lhs", dw1)):
            lhs, rhs = ((sds((t, d), BF16), sds((p, 2 * n), BF16)) if gathered == "lhs"
                        else (sds((p, n), BF16), sds((t, d), BF16)))
            f = functools.partial(weight_grad, gathered=gathered, out_dtype=BF16)
            lowered += [(c, jax.jit(functools.partial(f, config=c)).trace(
                lhs, rhs, sds((p,), jnp.int32), sds((e,), jnp.int32)).lower(
                    lowering_platforms=("cuda",))) for c in cfgs[1:]]
    for config, low in lowered:
        assert "setmaxnreg" not in low.as_text(), config


# ----------------------------------------------------------------------------- dX~


@pytest.mark.slow
@pytest.mark.parametrize("detect_races", [False, True], ids=["plain", "races"])
def test_dx_rows(detect_races):
    plan = make_plan(10, 45, 4, 2, router="token_rounding", empty=(3,))
    ks = jax.random.split(jax.random.key(11), 2)
    d, n = 128, 64
    dh = padded_random(ks[0], plan, 2 * n)
    w1 = jax.random.normal(ks[1], (4, d, 2 * n)).astype(BF16)
    got = dx_rows(dh, plan.group_sizes, w1, capacity=plan.capacity, config=GroupedMatmulConfig(block_n=64, num_sms=3),
                  interpret=interp(detect_races), out_cols=256)
    assert got.shape == (plan.capacity, 256)
    expert = jnp.minimum(plan.expert_ids, 3)
    ref = jnp.einsum("pf,pdf->pd", real_rows(dh, plan).astype(jnp.float32),
                     w1[expert].astype(jnp.float32), precision=HIGHEST)
    rows = int(plan.num_rows)
    assert_close(got[:rows, :d], ref[:rows], 1e-2, "dx_rows")
    assert_untouched(got[:, d:], 0)  # pad columns are not written
    assert_untouched(got, rows)  # nor padding rows
    if detect_races:
        assert not races_found()


# ----------------------------------------------------------------------------- errors


def _abstract_args(num_tokens, d, n, num_experts, k):
    sd = jax.ShapeDtypeStruct
    plan = jax.eval_shape(lambda l: pm.routing.topk_plan(l, k), sd((num_tokens, num_experts),
                                                                   jnp.float32))
    p = num_tokens * k
    return (sd((num_tokens, d), BF16), sd((p, 2 * n), BF16), plan,
            sd((num_experts, d, 2 * n), BF16), sd((num_experts, n, d), BF16),
            sd((num_tokens, d), BF16))


@pytest.mark.parametrize(
    "d, n, match",
    [(100, 64, r"d=100 must be a multiple of 64"), (128, 96, r"n=96 must be a multiple of 64")],
)
def test_unaligned_widths_raise(d, n, match):
    args = _abstract_args(16, d, n, 2, 1)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(moe_backward, interpret=True), *args)


def test_bad_config_and_shapes_raise():
    args = _abstract_args(16, 128, 64, 2, 1)
    cfg = BackwardConfig.for_shape(128, 64, dh=DHConfig(block_n=128))
    with pytest.raises(ValueError, match=r"n \(w_down.shape\[1\]\)=64 must be a multiple of 128"):
        jax.eval_shape(functools.partial(moe_backward, interpret=True, config=cfg), *args)
    cfg = BackwardConfig.for_shape(128, 64, dw_down=WeightGradConfig(block_m=64, block_k=128))
    with pytest.raises(ValueError, match="block_k must be equal"):
        jax.eval_shape(functools.partial(moe_backward, interpret=True, config=cfg), *args)
    x, h, plan, w1, w2, g = args
    # The epilogue's A' and H tiles (48 KB) overlay 3 W2 slots of [2 * 64, 64] bf16 and one
    # slot must stay free: 2 stages are too few.
    cfg = BackwardConfig.for_shape(
        128, 64, dh=DHConfig(block_n=64, num_stages=2, num_consumers=2))
    args256 = _abstract_args(16, 128, 128, 2, 1)
    with pytest.raises(ValueError, match="config.num_stages=2 is too few .* num_stages >= 4"):
        jax.eval_shape(functools.partial(moe_backward, interpret=True, config=cfg), *args256)
    bad_h = jax.ShapeDtypeStruct((h.shape[0] + 1, h.shape[1]), BF16)
    with pytest.raises(ValueError, match="h must have shape"):
        jax.eval_shape(functools.partial(moe_backward, interpret=True), x, bad_h, plan, w1, w2, g)
    with pytest.raises(TypeError, match="grad_out must have dtype bfloat16"):
        jax.eval_shape(
            functools.partial(dh_kernel, interpret=True),
            jax.ShapeDtypeStruct(g.shape, jnp.float32),
            h, plan.token_ids, plan.group_sizes, plan.scores, w2,
        )


@pytest.mark.parametrize("d, n", [(1536, 256), (2880, 1408), (4096, 512), (7168, 2048),
                                  (4096, 768), (1536, 1024), (2880, 2880), (1536, 320)])
def test_real_widths_have_configs(d, n):
    cfg = BackwardConfig.for_shape(d, n)
    cons = lambda c: c.num_consumers
    assert n % (cfg.dh.block_n * cons(cfg.dh)) == 0 and d % cfg.dx.block_n == 0
    assert n % (cfg.dw_down.block_m * cons(cfg.dw_down)) == 0 and d % cfg.dw_down.block_n == 0
    assert d % cfg.dw_gate_up.block_m == 0
    assert (2 * n) % (cfg.dw_gate_up.block_n * cons(cfg.dw_gate_up)) == 0


# ----------------------------------------------------------------------------- cuda lowering


def _lower_for_cuda(num_tokens, d, n, num_experts, k, gather="cp_async", **dx_overrides):
    """Lowers the whole backward for cuda at the width's default configs, with
    `dx_overrides` set on dX~'s config (e.g. `wgmma_lag=0`)."""
    args = _abstract_args(num_tokens, d, n, num_experts, k)
    config = BackwardConfig.for_shape(d, n, gather=gather)
    if dx_overrides:
        config = dataclasses.replace(config, dx=dataclasses.replace(config.dx, **dx_overrides))
    f = jax.jit(functools.partial(moe_backward, interpret=False, config=config))
    return f.trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("gather", ["cp_async", "tma"])
def test_lowers_for_cuda_7b(gather):
    """Production block sizes at the 7B shape lower for cuda, with either row loader."""
    _lower_for_cuda(24576, 1536, 256, 128, 8, gather)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [(32768, 4096, 512, 128, 8), (4096, 2880, 1408, 8, 2), (4096, 7168, 2048, 8, 2),
     (4096, 4096, 768, 8, 2), (4096, 1536, 1024, 8, 2)],
    ids=["30b", "d2880_n1408", "d7168_n2048", "d4096_n768", "d1536_n1024"],
)
def test_lowers_for_cuda_large(shape):
    _lower_for_cuda(*shape)


@pytest.mark.parametrize("shape", [(32768, 4096, 512, 128, 8), (8192, 2880, 2880, 32, 4)],
                         ids=["30b", "gpt_oss"])
def test_wgmma_lag_0_backward_lowers_for_cuda(shape):
    """The whole backward with dX~ releasing each slot as soon as its own K step's wgmmas
    are done (`wgmma_lag=0`, what `backward.py --sweep lag` times; dH and the weight
    gradients lost the option in session 64) lowers for cuda at production widths (30B:
    3-stage dX~; gpt-oss: 3-stage 192-column items)."""
    _lower_for_cuda(*shape, wgmma_lag=0)


@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_dx_wgmma_lag_follows_the_device_and_items(kind):
    """dX~'s 192-column, 3-stage items (gpt-oss's d = 2880) release each slot as soon as
    its own step's wgmmas are done on the H100 (`wgmma_lag=0`, session 64: 1.047x), as the
    forward's down-proj of the same items does; every other dX~ default keeps lag 1, and
    the H200 (not measured) keeps lag 1 everywhere. (The whole backward at gpt-oss's widths,
    lag 0 included, lowers in `test_three_consumers_lower_for_cuda_at_gpt_oss_widths`.)"""
    h100 = not kind.endswith("H200")
    dx = BackwardConfig.for_shape(2880, 2880, num_sms=132, device_kind=kind).dx
    assert (dx.block_n, dx.num_stages, dx.wgmma_lag) == (192, 3, 0 if h100 else 1), dx
    for d, n in ((1536, 256), (1536, 1024), (2048, 768), (4096, 512), (7168, 2048)):
        dx = BackwardConfig.for_shape(d, n, num_sms=132, device_kind=kind).dx
        assert dx.block_n != 192 and dx.wgmma_lag == 1, (d, n, dx)


def test_three_consumers_lower_for_cuda_at_gpt_oss_widths():
    """Where 128 does not divide n but 192 does (gpt-oss-20b: d = n = 2880), dH and both
    weight gradients default to three consumer warpgroups of 64 beside the producer
    (on the H100, session 48: dH 2.07x one consumer; session 49: dW2 1.80x one, dW1 1.21x
    two), on every card; the whole backward lowers for cuda at production sizes."""
    t, d, n, e, k = 8192, 2880, 2880, 32, 4
    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", ""):
        cfg = BackwardConfig.for_shape(d, n, device_kind=kind, num_sms=132)
        assert (cfg.dh.block_n, cfg.dh.num_consumers, cfg.dh.num_stages) == (64, 3, 4), kind
        assert (cfg.dw_down.block_m, cfg.dw_down.num_consumers) == (64, 3), kind
        assert (cfg.dw_gate_up.block_n, cfg.dw_gate_up.num_consumers) == (64, 3), kind
        # both stay persistent: 4 stages and three output buffers fit in SMEM
        assert cfg.dw_down.persistent_ctas == cfg.dw_gate_up.persistent_ctas == 132, kind
    _lower_for_cuda(t, d, n, e, k)
    # 64 * 5: neither 128 nor 192 divides n, so one consumer stays (two in dW1: 2n = 640)
    narrow = BackwardConfig.for_shape(1536, 320)
    assert (narrow.dh.num_consumers, narrow.dw_down.num_consumers,
            narrow.dw_gate_up.num_consumers) == (1, 1, 2)


@pytest.mark.parametrize(
    "num_tokens, d, stages, num_ctas, block_n, consumers",
    [(60, 448, 5, 1, 64, 2), (60, 64, 4, 2, 64, 2), (70, 192, 5, 2, 128, 2),
     # CI time: the same item walk as two CTAs (item = cta + j * num_ctas), and one
     # consumer warpgroup (the default below n = 128); opt-in extras.
     pytest.param(90, 128, 4, 3, 64, 2, marks=pytest.mark.slow),
     pytest.param(50, 256, 4, 2, 64, 1, marks=pytest.mark.slow),
     # four consumers of 64 columns (session 56's c4 probe; opt-in)
     pytest.param(60, 448, 5, 1, 64, 4, marks=pytest.mark.slow)],
    ids=["one_cta_7_k_steps", "k_steps_within_free_slots", "two_slab_tiles", "three_ctas",
         "one_consumer", "four_consumers"],
)
def test_dh_kernel_no_races(num_tokens, d, stages, num_ctas, block_n, consumers):
    """The dH kernel with the race detector, bitwise against the kernel-order reference
    (and close to the f32 one): one CTA walking every item (7 K steps over 5 slots, two of
    them free during the epilogue), an item shorter than the free slots (d = 64: the
    producer waits for the epilogue before its only K step), 3 CTAs, one consumer, and
    block_n = 128 (the 7B default's epilogue tiles: two 64-column slabs each); an empty
    expert gives empty tiles to skip, and with one consumer each tile has 2 column blocks.
    H is loaded by the TMA ladder here: interpret mode runs that loader for
    `h_loader="cp_async"` too (the cp.async loader: lowering and GPU tests)."""
    n = max(2, consumers) * block_n
    x, h, plan, w1, w2, grad_out = make_problem(8, num_tokens, d, n, 3, 2, empty=(1,))
    args = (grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    config = DHConfig(block_n=block_n, num_stages=stages, num_consumers=consumers,
                      persistent_ctas=num_ctas, h_loader="cp_async")
    got = dh_kernel(*args, config=config, interpret=interp(detect_races=True))
    assert not races_found()
    check_dh(got, grad_out, h, plan, w2, config)


def test_dh_refuses_removed_settings():
    """`cluster_m` (removed in session 62: no gain on the H100), `wgmma_lag` (session
    64: level on the H100) and `gather_completion` (session 64: mbarrier stages 0.93-1.00x
    on an H200) are a TypeError, not ignored."""
    for removed in (dict(cluster_m=2), dict(wgmma_lag=0), dict(gather_completion="mbarrier")):
        with pytest.raises(TypeError, match=next(iter(removed))):
            DHConfig(**removed)


def test_dh_three_consumers_write_one_consumers_bits():
    """Three consumers of 64 columns (the default where 192 but not 128 divides n, e.g.
    gpt-oss's 2880) compute each element with the same K loop and epilogue as one consumer,
    and write the same 64-column partial sums of dS, so all three outputs are bitwise the
    single consumer's (the kernel-order reference's too); race-free with four warpgroups;
    skewed routing with an empty expert, tiles ending mid-tile."""
    x, h, plan, w1, w2, grad_out = make_problem(21, 50, 128, 192, 3, 2, skew=2.0, empty=(1,))
    args = (grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    three = BackwardConfig.for_shape(128, 192, num_sms=2).dh
    assert (three.block_n, three.num_consumers) == (64, 3)
    got = dh_kernel(*args, config=three, interpret=interp(detect_races=True))
    assert not races_found()
    check_dh(got, grad_out, h, plan, w2, three)
    one = dataclasses.replace(three, num_consumers=1)
    assert_dh_outputs_equal(got, dh_kernel(*args, config=one, interpret=True),
                            int(plan.num_rows))


# CI time (an opt-in extra): test_dh_kernel_no_races runs 1 and 2 CTAs, each bitwise its
# kernel-order reference (which no CTA count changes); epilogue_cols=0 is no default.
@pytest.mark.slow
def test_dh_kernel_same_bits_for_every_cta_count_and_epilogue_chunk():
    """Configs that must write the same bits do: one CTA walking all 2 x 6 items and 3 CTAs
    (dH, A' and dS), and the epilogue over the whole 128-column block at once
    (`epilogue_cols=0`) against two 64-column chunks (dH and A'; its dS adds the 128
    columns in one sum where the chunks add two 64-column sums, another rounding), each
    also bitwise the kernel-order reference of its own config (`check_dh`); skewed routing
    with an empty expert, so tiles end mid-tile and some are empty."""
    x, h, plan, w1, w2, grad_out = make_problem(9, 60, 128, 256, 4, 2, skew=3.0, empty=(2,))
    args = (grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    base = DHConfig(block_n=128, num_stages=4, num_consumers=1, persistent_ctas=1)
    want = dh_kernel(*args, config=base, interpret=True)
    check_dh(want, grad_out, h, plan, w2, base)
    rows = int(plan.num_rows)
    three_ctas = dataclasses.replace(base, persistent_ctas=3)
    assert_dh_outputs_equal(dh_kernel(*args, config=three_ctas, interpret=True), want, rows)
    whole = dataclasses.replace(base, epilogue_cols=0, persistent_ctas=2)
    got = dh_kernel(*args, config=whole, interpret=True)
    check_dh(got, grad_out, h, plan, w2, whole)
    assert_dh_outputs_equal(got[:2], want[:2], rows)


@pytest.mark.parametrize("grid_n", [1, 2, 15])
def test_dh_items_walk_each_row_tiles_column_blocks_together(grid_n):
    """The persistent dH's work items (`dh.item_coords`) cover every (row tile, column
    block) once, with a row tile's column blocks consecutive, so neighbouring CTAs gather
    the same dO rows at once (session 59; row tiles fastest made each column block a
    separate pass over dO)."""
    from pallas_moe.kernels.dh import item_coords

    num_tiles = 7
    walk = [tuple(int(v) for v in item_coords(jnp.int32(w), grid_n))
            for w in range(num_tiles * grid_n)]
    assert sorted(walk) == [(t, j) for t in range(num_tiles) for j in range(grid_n)]
    assert walk[:grid_n] == [(0, j) for j in range(grid_n)]
    assert walk[grid_n] == (1, 0)


def test_dh_config_errors():
    """Bad configs are refused naming the field; the removed knobs (sessions 42 and 48) no
    longer exist; the kernel loads H after the K loop and needs a free W2 slot."""
    x, h, plan, w1, w2, grad_out = make_problem(8, 20, 128, 128, 2, 2)
    args = (grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    base = DHConfig(block_n=64, num_stages=4, num_consumers=2, persistent_ctas=2)
    for bad, match in [(dict(num_consumers=0, gather="tma"), "num_consumers=0 must be >= 1"),
                       (dict(persistent_ctas=0), "config.persistent_ctas=0 must be >= 1"),
                       (dict(persistent_ctas=-1), "config.persistent_ctas=-1 must be >= 1"),
                       (dict(num_stages=3), "num_stages=3 is too few .* num_stages >= 4"),
                       (dict(h_loader="bulk"), "h_loader='bulk' must be one of"),
                       (dict(epilogue_cols=32),
                        "epilogue_cols=32 must be 0 or a multiple of 64 dividing block_n=64"),
                       (dict(epilogue_cols=128),
                        "epilogue_cols=128 must be 0 or a multiple of 64 dividing block_n=64"),
                       (dict(num_stages=10), "needs 245760 B of SMEM for 10 stages")]:
        with pytest.raises(ValueError, match=match):
            dh_kernel(*args, config=dataclasses.replace(base, **bad), interpret=True)
    for removed in (dict(prefetch_h=True), dict(early_h=True),
                    dict(epilogue_layout="untiled"), dict(epilogue_layout="swizzled"),
                    dict(split_m=True), dict(epilogue_buffers=2), dict(h_prefetch_steps=8),
                    dict(schedule="pingpong"), dict(store="registers")):
        with pytest.raises(TypeError, match=next(iter(removed))):
            DHConfig(**removed)
    assert DHConfig().persistent_ctas == 132
    jax.eval_shape(functools.partial(dh_kernel, config=DHConfig()), *args)  # a valid default


def test_dh_persistent_producer_observes_every_epilogue_phase(monkeypatch):
    """An item with no more K steps than free slots (d = 64: one step, the epilogue tiles
    overlay 3 of 4 W2 slots): the producer waits for the previous item's epilogue
    (`epi_done`) before the item's last step. Session 28 found it waiting after that step,
    which let the consumers finish the whole item and complete `epi_done`'s next phase before
    the producer observed the previous one: interpret mode raised "Barrier completed phase 1,
    but no threads observed phase 0" in ~1 of 10 loaded runs (on the GPU the wait would block
    on a phase that never completes). Here every producer wait on `epi_done` first sleeps,
    so the consumers run as far ahead as the protocol lets them; then bitwise against the
    kernel-order reference."""
    import time

    from jax._src import source_info_util
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    wait = gpu_callbacks._barrier_wait

    def late_epilogue_wait(token, mesh_location, thread, key, source_info=None):
        frame = source_info_util.user_frame(source_info.traceback) if source_info else None
        if (frame is not None and frame.file_name.endswith("dh.py")
                and "barrier_wait(epi_done)" in _source_line(frame)
                and int(np.asarray(mesh_location.thread_id)) == 1):  # the producer
            time.sleep(1.0)
        return wait(token, mesh_location, thread, key, source_info=source_info)

    monkeypatch.setattr(gpu_callbacks, "_barrier_wait", late_epilogue_wait)
    x, h, plan, w1, w2, grad_out = make_problem(8, 40, 64, 128, 3, 2)
    args = (grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    config = DHConfig(block_n=64, num_stages=4, num_consumers=1, persistent_ctas=2,
                      h_loader="cp_async")
    got = dh_kernel(*args, config=config, interpret=True)
    assert_dh_outputs_equal(got, dh_kernel_order_reference(grad_out, h, plan, w2, config),
                            int(plan.num_rows))


def _source_line(frame) -> str:
    import linecache

    return linecache.getline(frame.file_name, frame.start_line)


# ----------------------------------------------------------------------------- split dH


def test_gathered_bf16_grouped_gemm_equals_contiguous_rows_no_races():
    """The grouped GEMM's gathered mode in bf16 (the split dH's `dA' = dO[tok] @ W2[e]^T`,
    f32 out): bitwise the contiguous mode over rows gathered beforehand, close to the f32
    reference, padding rows untouched, race-free with two CTAs walking items of two
    column blocks (skewed routing with an empty expert: tiles ending mid-box)."""
    from pallas_moe.kernels.grouped_gemm import grouped_matmul

    x, h, plan, w1, w2, grad_out = make_problem(31, 70, 128, 256, 3, 2, skew=2.0, empty=(1,))
    cfg = GroupedMatmulConfig(block_m=128, block_n=128, num_stages=3, num_sms=2)
    common = dict(transpose_w=True, config=cfg, out_dtype=jnp.float32, capacity=plan.capacity)
    got = grouped_matmul(grad_out, plan.group_sizes, w2, token_ids=plan.token_ids,
                         interpret=interp(detect_races=True), **common)
    assert not races_found()
    want = grouped_matmul(grad_out[plan.token_ids], plan.group_sizes, w2, interpret=True,
                          **common)
    rows = int(plan.num_rows)
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and np.all(np.isfinite(got[:rows]))
    assert np.array_equal(got[:rows], want[:rows])
    assert_untouched(got, rows)
    expert = np.minimum(np.asarray(plan.expert_ids), 2)[:rows]
    do = np.asarray(grad_out, np.float32)[np.asarray(plan.token_ids)[:rows]]
    ref = np.einsum("pd,pnd->pn", do, np.asarray(w2, np.float32)[expert])
    assert rel_err(got[:rows], ref) < 1e-5


@pytest.mark.parametrize("n, vec", [(128, 1), (256, 2), (512, 4)])
@pytest.mark.parametrize("clamped", [False, True], ids=["silu", "clamped"])
def test_dswiglu_rows_is_the_fused_epilogue_per_row(n, vec, clamped):
    """The split dH's row pass on its own: each real row's dH and A' are the bits of the
    fused kernel's epilogue math (`dswiglu_epilogue`, jitted, on the same f32 dA'), dS its
    row sum within f32 rounding and 0 past the real rows, whose dH / A' rows stay unwritten
    (their dA' and H hold NaN); every width's vector size (n / 128 = 1, 2, 4 f32 per
    thread); rows past P in the last CTA; both SwiGLU kinds; race-free (dS's reduction
    goes through SMEM)."""
    from pallas_moe.kernels.dh import dswiglu_epilogue, dswiglu_rows

    assert next(v for v in (4, 2, 1) if n % (128 * v) == 0) == vec
    act = pm.ops.SwiGLU.clamped(limit=1.5) if clamped else pm.ops.SwiGLU()
    capacity, real = 23, 19  # 6 CTAs of 4 rows: the last holds a row past P
    ks = jax.random.split(jax.random.key(n + clamped), 3)
    da = jax.random.normal(ks[0], (capacity + 5, n), jnp.float32)
    h = jax.random.normal(ks[1], (capacity, 2 * n)).astype(BF16)
    valid = jnp.arange(capacity) < real
    h = jnp.where(valid[:, None], h, jnp.nan).astype(BF16)
    da = da.at[real:].set(jnp.nan)
    s = jax.random.uniform(ks[2], (capacity,), jnp.float32)
    out_rows = 32
    dh, ap, ds = dswiglu_rows(da, h, s, jnp.array([real], jnp.int32), out_rows=out_rows,
                              activation=act, interpret=interp(detect_races=True))
    assert not races_found()
    assert dh.shape == (out_rows, 2 * n) and ap.shape == (out_rows, n) and ds.shape == (capacity,)
    hf = h[:real].astype(jnp.float32)
    want = jax.jit(functools.partial(dswiglu_epilogue, activation=act))(
        da[:real], hf[:, :n], hf[:, n:], jnp.broadcast_to(s[:real, None], (real, n)))
    d_gate, d_up, a_s, ds_want = (np.asarray(w) for w in want)
    np.testing.assert_array_equal(np.asarray(dh[:real, :n]), d_gate.astype(BF16))
    np.testing.assert_array_equal(np.asarray(dh[:real, n:]), d_up.astype(BF16))
    np.testing.assert_array_equal(np.asarray(ap[:real]), a_s.astype(BF16))
    np.testing.assert_allclose(np.asarray(ds[:real]), ds_want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(ds[real:]))
    assert_untouched(dh, real)
    assert_untouched(ap, real)


def test_dswiglu_rows_widens_a_bf16_da():
    """The row pass on a bf16 dA' (`dh_split(da_dtype=bfloat16)`): each real row's dH, A'
    and dS are the f32 pass's on the same values widened to f32, bit for bit (the load
    widens; the math is unchanged); rows past the real ones stay unwritten."""
    from pallas_moe.kernels.dh import dswiglu_rows

    capacity, real, n = 21, 17, 256
    ks = jax.random.split(jax.random.key(5), 3)
    da = jax.random.normal(ks[0], (capacity, n)).astype(BF16).at[real:].set(jnp.nan)
    h = jnp.where((jnp.arange(capacity) < real)[:, None],
                  jax.random.normal(ks[1], (capacity, 2 * n)), jnp.nan).astype(BF16)
    s = jax.random.uniform(ks[2], (capacity,), jnp.float32)
    rows = jnp.array([real], jnp.int32)
    got = dswiglu_rows(da, h, s, rows, out_rows=24, interpret=True)
    want = dswiglu_rows(da.astype(jnp.float32), h, s, rows, out_rows=24, interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g)[:real], np.asarray(w)[:real])
    assert not np.any(np.asarray(got[2])[real:])
    assert_untouched(got[0], real)
    assert_untouched(got[1], real)


def test_dh_split_with_a_bf16_da_rounds_only_da():
    """`dh_split(da_dtype=bfloat16)`: the GEMM's dA' is its f32 accumulator rounded to bf16,
    so dH and dS are the row pass's on the f32 split's dA' rounded, bit for bit, and A'
    (which does not read dA') is the f32 split's; close to the f32 reference at the same
    tolerance as the fused kernel; skewed routing with an empty expert."""
    from pallas_moe.kernels.dh import dh_split, dswiglu_rows
    from pallas_moe.kernels.grouped_gemm import grouped_matmul

    x, h, plan, w1, w2, grad_out = make_problem(33, 70, 128, 256, 3, 2, skew=2.0, empty=(1,))
    args = (grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    gemm = GroupedMatmulConfig(block_m=128, block_n=256, num_stages=3, num_sms=2, out_slabs=1)
    got = dh_split(*args, gemm=gemm, interpret=True, da_dtype=BF16)
    f32 = dh_split(*args, gemm=gemm, interpret=True)
    da = grouped_matmul(grad_out, plan.group_sizes, w2, transpose_w=True, config=gemm,
                        interpret=True, capacity=plan.capacity, out_dtype=jnp.float32,
                        token_ids=plan.token_ids)
    rows = int(plan.num_rows)
    want = dswiglu_rows(da.astype(BF16), h, plan.scores, jnp.array([rows], jnp.int32),
                        out_rows=got[0].shape[0], interpret=True)
    np.testing.assert_array_equal(np.asarray(got[0])[:rows], np.asarray(want[0])[:rows])
    np.testing.assert_array_equal(np.asarray(got[1])[:rows], np.asarray(f32[1])[:rows])
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    assert not np.array_equal(np.asarray(got[0])[:rows], np.asarray(f32[0])[:rows])
    assert_untouched(got[0], rows)
    assert_untouched(got[1], rows)
    ref_dh, ref_a, ref_ds = dh_reference(grad_out, h, plan, w2)
    assert_close(got[0][:rows], ref_dh[:rows], 1e-2, "dh")
    assert_close(got[2], ref_ds, 1e-2, "d_scores")
    with pytest.raises(TypeError, match="da_dtype must be float32 or bfloat16"):
        dh_split(*args, gemm=gemm, interpret=True, da_dtype=jnp.float16)


def test_dswiglu_rows_errors():
    """Bad operands are refused naming the argument."""
    from pallas_moe.kernels.dh import dswiglu_rows

    da = jnp.zeros((8, 128), jnp.float32)
    h, s, nr = jnp.zeros((8, 256), BF16), jnp.zeros((8,), jnp.float32), jnp.array([8], jnp.int32)
    cases = [
        ((da[:, :64], h[:, :128], s, nr), {}, ValueError, r"n \(da.shape\[1\]\)=64 must be a multiple of 128"),
        ((da.astype(jnp.float16), h, s, nr), {}, TypeError,
         "da must have dtype float32 or bfloat16"),
        ((da, h.astype(jnp.float32), s, nr), {}, TypeError, "h must have dtype bfloat16"),
        ((da[:4], h, s, nr), {}, ValueError, r"da.shape\[0\]=4 must be >= scores.shape\[0\]=8"),
        ((da, h[:, :128], s, nr), {}, ValueError, "h must have shape"),
        ((da, h, s, nr), dict(out_rows=4), ValueError, "out_rows=4 must be >= scores.shape"),
        ((da, h, s, nr), dict(rows_per_cta=0), ValueError, "rows_per_cta=0 must be >= 1"),
    ]
    for args, kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            jax.eval_shape(functools.partial(dswiglu_rows, **{"out_rows": 8, **kw},
                                             interpret=True), *args)


@pytest.mark.parametrize("plan_kw", [dict(skew=2.0, empty=(1,)),
                                     dict(router="token_rounding", tile=16)],
                         ids=["skewed_empty_expert", "token_rounding_padding"])
def test_dh_split_writes_the_fused_kernels_bits(plan_kw):
    """dH split in two (`dh_split`: the gathered GEMM, then the row pass) writes the fused
    kernel's dH and A' bit for bit (each element's dA' sums the same K steps in the same
    order; the same epilogue math), dS within f32 rounding of it and 0 on padding rows, the
    padding rows of dH and A' unwritten; close to the f32 reference; skewed routing with
    an empty expert, and token rounding's padding rows (NaN in H there)."""
    from pallas_moe.kernels.dh import dh_split

    x, h, plan, w1, w2, grad_out = make_problem(33, 70, 128, 256, 3, 2, **plan_kw)
    args = (grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    gemm = GroupedMatmulConfig(block_m=128, block_n=256, num_stages=3, num_sms=2, out_slabs=1)
    got = dh_split(*args, gemm=gemm, interpret=True)
    fused = dh_kernel(*args, config=BackwardConfig.for_shape(128, 256, num_sms=2).dh,
                      interpret=True)
    rows = int(plan.num_rows)
    assert_dh_outputs_equal(got[:2], fused[:2], rows)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(fused[2]), rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(got[2])[rows:])
    assert_untouched(got[0], rows)
    assert_untouched(got[1], rows)
    ref_dh, ref_a, ref_ds = dh_reference(grad_out, h, plan, w2)
    assert_close(got[0][:rows], ref_dh[:rows], 1e-2, "dh")
    assert_close(got[1][:rows], ref_a[:rows], 1e-2, "a_scaled")
    assert_close(got[2], ref_ds, 1e-4, "d_scores")


@pytest.mark.parametrize("da_dtype", ["float32", "bfloat16"])
def test_backward_with_split_dh(da_dtype):
    """The whole backward with dH split in two (what `for_shape` picks at d >= 2048, here
    forced at small widths), dA' in bf16 (`for_shape`'s) or f32 (`dh_da_dtype`), against
    `moe_ffn_backward`: a token-rounding plan (padding rows) with an empty expert (zero
    weight gradients), dS 0 on padding; then with the metadata from `plan_schedules` (the
    GEMM's aligned 128-row tiles), bitwise the same."""
    problem = make_problem(35, 60, 128, 256, 4, 2, router="token_rounding", empty=(2,))
    config = BackwardConfig.for_shape(128, 256, num_sms=4)
    assert config.dh_gemm is None  # d < 2048: the fused kernel by default
    config = dataclasses.replace(config, dh_da_dtype=da_dtype, dh_gemm=GroupedMatmulConfig(
        block_m=128, block_n=128, num_stages=3, num_sms=4))
    got = check_backward(problem, config)
    assert_plan_schedules_give_the_same_gradients(problem, config, got, dh_rows=128)


@pytest.mark.parametrize("da_dtype", ["bfloat16", "float32"])
def test_split_dh_with_a_plan_that_dropped_every_row(da_dtype):
    """An empty plan (token rounding down, every row dropped) through the backward with dH
    split, dA' in bf16 (`for_shape`'s from d = 2048) or f32: the GEMM has no tiles, the row
    pass writes dS = 0 and no dH / A' row, and every gradient is exactly zero although H
    and dO's padding would be NaN if read."""
    num_tokens, d, n, num_experts = 16, 128, 128, 4
    logits = jax.random.normal(jax.random.key(41), (num_tokens, num_experts))
    plan = pm.routing.token_rounding_plan(logits, 1, tile=64, rounding="down")
    assert int(plan.num_rows) == 0
    ks = jax.random.split(jax.random.key(42), 3)
    x = jax.random.normal(ks[0], (num_tokens, d)).astype(BF16)
    w1 = (jax.random.normal(ks[1], (num_experts, d, 2 * n)) / np.sqrt(d)).astype(BF16)
    w2 = (jax.random.normal(ks[2], (num_experts, n, d)) / np.sqrt(n)).astype(BF16)
    h = jnp.full((plan.capacity, 2 * n), jnp.nan, BF16)
    grad_out = jnp.ones((num_tokens, d), BF16)
    config = dataclasses.replace(BackwardConfig.for_shape(d, n, num_sms=2), dh_gemm=(
        GroupedMatmulConfig(block_m=128, block_n=128, num_stages=3, num_sms=2)),
        dh_da_dtype=da_dtype)
    grads = moe_backward(x, h, plan, w1, w2, grad_out, interpret=True, config=config)
    for g in grads:
        assert not np.any(np.asarray(g, np.float32)), "an empty plan gives zero gradients"


def test_split_dh_is_picked_where_measured_and_validated():
    """`for_shape` splits dH at d >= 2048 with the up-proj's 128 x 256 items and dA' in
    bf16 (on the H100, session 63: 30B 1.235x the fused kernel, Qwen3's d = 2048 1.083x);
    not at 7B (0.994x) or where 256 does not divide n. A config the gathered mode cannot
    run is refused naming the field."""
    split = BackwardConfig.for_shape(4096, 512, num_sms=132).dh_gemm
    assert (split.block_m, split.block_n, split.num_stages, split.out_slabs,
            split.gather, split.num_sms) == (128, 256, 4, 1, "cp_async", 132)
    assert split == dh_split_gemm_config(132)
    assert BackwardConfig.for_shape(4096, 512, gather="tma").dh_gemm.gather == "tma"
    for d, n in ((4096, 512), (2048, 768), (7168, 2048)):
        cfg = BackwardConfig.for_shape(d, n)
        assert cfg.dh_gemm is not None and cfg.dh_da_dtype == "bfloat16", (d, n)
    for d, n in ((1536, 256), (1536, 1024), (4096, 384), (2880, 2880)):
        cfg = BackwardConfig.for_shape(d, n)
        assert cfg.dh_gemm is None and cfg.dh_da_dtype == "float32", (d, n)
    # The fused dH asked for by name drops the split's dA' dtype; f32 dA' kept on request.
    assert BackwardConfig.for_shape(4096, 512, dh_gemm=None).dh_da_dtype == "float32"
    assert BackwardConfig.for_shape(4096, 512, dh_da_dtype="float32").dh_gemm == split
    with pytest.raises(ValueError, match="dh_gemm runs the grouped GEMM's gathered mode"):
        BackwardConfig(dh_gemm=GroupedMatmulConfig(pingpong=True))
    with pytest.raises(TypeError, match="dh_gemm must be a GroupedMatmulConfig or None"):
        BackwardConfig(dh_gemm=DHConfig())
    # The dA' dtype: only for the split dH, and only the two dtypes.
    assert BackwardConfig(dh_gemm=split).dh_da_dtype == "float32"  # the field's default
    assert BackwardConfig(dh_gemm=split, dh_da_dtype="bfloat16").dh_da_dtype == "bfloat16"
    with pytest.raises(ValueError, match="dh_da_dtype must be 'float32' or 'bfloat16'"):
        BackwardConfig(dh_gemm=split, dh_da_dtype="float16")
    with pytest.raises(ValueError, match="needs dh_gemm"):
        BackwardConfig(dh_da_dtype="bfloat16")


@pytest.mark.parametrize("shape,da_dtype", [((32768, 4096, 512, 128, 8), "float32"),
                                            ((24576, 1536, 256, 128, 8), "bfloat16")],
                         ids=["30b_f32", "7b_bf16"])
def test_split_dh_forms_off_the_defaults_lower_for_cuda(shape, da_dtype):
    """dH split in two in the forms `for_shape` does not pick lower for cuda at production
    sizes: at 30B with dA' in f32 (`dh_da_dtype="float32"`: the GEMM's f32 output slabs, the
    row pass's 16-byte f32 loads), at 7B forced with dA' in bf16 (its default is fused; 4-byte
    bf16 loads a thread at n = 256)."""
    T, d, n, E, K = shape
    config = BackwardConfig.for_shape(d, n)
    gemm = config.dh_gemm or dh_split_gemm_config(132)
    config = dataclasses.replace(config, dh_gemm=gemm, dh_da_dtype=da_dtype)
    f = jax.jit(functools.partial(moe_backward, interpret=False, config=config))
    text = f.trace(*_abstract_args(T, d, n, E, K)).lower(lowering_platforms=("cuda",)).as_text()
    assert "moe_dh_gemm" in text and "moe_dh_rows" in text


@pytest.mark.parametrize("shape", [(32768, 4096, 512, 128, 8), (32768, 2048, 768, 128, 8)],
                         ids=["30b", "qwen3_30b_a3b"])
def test_split_dh_lowers_for_cuda(shape):
    """The backward's default at d >= 2048, dH split in two with dA' in bf16, lowers for
    cuda at production sizes (the gathered GEMM's 4 stages of 48 KB beside one bf16 output
    slab per consumer, then the row pass's bf16 dA' loads: 8 bytes a thread at n = 512, 4
    at n = 768)."""
    T, d, n, E, K = shape
    config = BackwardConfig.for_shape(d, n)
    assert config.dh_gemm is not None and config.dh_da_dtype == "bfloat16"
    text = _lower_for_cuda(*shape).as_text()
    assert "moe_dh_gemm" in text and "moe_dh_rows" in text
