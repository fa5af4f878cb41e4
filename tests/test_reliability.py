"""Reliability of the library: non-finite values stay where they are, or are reported by name.

One test (or parametrized group) per library row of the reliability table (issue 10):
padding rows that carried NaN, 0/0 in renormalization, non-finite selection bias or bias
rate, NaN in a layer's x, `backend="mosaic"` without a Hopper GPU, NumPy float64 input,
and hand-built plans. The expert-parallel NaN case runs in a subprocess with 8 CPU devices
(`tests/ep_nan_check.py`). References are float64 NumPy loops.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import pallas_moe as pm
from pallas_moe.kernels.reference import moe_forward_reference
from pallas_moe.ops.moe_ffn import resolve_backend
from pallas_moe.ops.mosaic import minimal_residual_moe_ffn

ROOT = Path(__file__).resolve().parents[1]
ON_HOPPER = jax.devices()[0].platform == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"


# ------------------------------------------------------------ padding never carries NaN


def reference_moe(x, plan, w_gate_up, w_down, grad_out):
    """float64 loop over the plan's real rows: (out, dx, d_scores, dw_gate_up, dw_down).

    Non-finite values propagate exactly as far as the math carries them: into the tokens a
    non-finite expert serves, and into the experts a non-finite token is routed to.
    """
    x, w1, w2, g = (np.asarray(a, np.float64) for a in (x, w_gate_up, w_down, grad_out))
    tok, scores = np.asarray(plan.token_ids), np.asarray(plan.scores, np.float64)
    sizes = np.asarray(plan.group_sizes)
    n = w2.shape[1]
    out, dx = np.zeros_like(x), np.zeros_like(x)
    dw1, dw2 = np.zeros_like(w1), np.zeros_like(w2)
    d_scores = np.zeros(plan.capacity)
    with np.errstate(all="ignore"):
        for r, e in enumerate(np.repeat(np.arange(len(sizes)), sizes)):
            t, s = tok[r], scores[r]
            h = x[t] @ w1[e]
            gate, up = h[:n], h[n:]
            sig = 1.0 / (1.0 + np.exp(-gate))
            a = gate * sig * up
            out[t] += s * (a @ w2[e])
            da = g[t] @ w2[e].T  # dL/d(A) before the score
            d_scores[r] = da @ a
            dw2[e] += s * np.outer(a, g[t])
            dgate = s * da * up * sig * (1 + gate * (1 - sig))
            dup = s * da * gate * sig
            dh = np.concatenate([dgate, dup])
            dw1[e] += np.outer(x[t], dh)
            dx[t] += w1[e] @ dh
    return out, dx, d_scores, dw1, dw2


def assert_same_nonfinite_and_close(got, want, name):
    got, want = np.asarray(got, np.float64), np.asarray(want)
    bad = np.isfinite(got) != np.isfinite(want)
    assert not bad.any(), (
        f"{name}: finiteness differs from the float64 reference at {np.argwhere(bad)[:8].tolist()} "
        f"(got {got[bad][:4]}, want {want[bad][:4]})"
    )
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-4, atol=2e-5, err_msg=name)


T, D, N, E, K = 24, 8, 4, 4, 2


def _routed_problem():
    """Token 0 routes to experts 0 and 1 only; expert 3 serves some tokens, never token 0."""
    kx, kl, k1, k2, kg = jax.random.split(jax.random.key(7), 5)
    logits = jax.random.normal(kl, (T, E))
    logits = logits.at[0].set(jnp.array([4.0, 3.0, -4.0, -4.0]))
    x = jax.random.normal(kx, (T, D))
    w_gate_up = jax.random.normal(k1, (E, D, 2 * N)) * 0.4
    w_down = jax.random.normal(k2, (E, N, D)) * 0.4
    grad_out = jax.random.normal(kg, (T, D))
    return x, pm.routing.topk_plan(logits, K), w_gate_up, w_down, grad_out


def _kernel_reference_moe_ffn(x, plan, w_gate_up, w_down):
    # The kernels' jnp forward reference with the minimal-activation backward
    # (ops/minimal_backward.py), i.e. the kernels' custom_vjp structure, pure jnp.
    return minimal_residual_moe_ffn(moe_forward_reference)(x, plan, w_gate_up, w_down)


PATHS = {
    "xla": lambda x, plan, w1, w2: pm.moe_ffn(x, plan, w1, w2, backend="xla"),
    "minimal_backward": _kernel_reference_moe_ffn,
}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(
    "where, index, value",
    [("w_down", 3, np.nan), ("w_gate_up", 3, np.inf), ("x", 0, np.nan), ("x", 0, -np.inf)],
)
def test_nonfinite_stays_in_its_tokens_and_experts(path, where, index, value):
    """NaN/Inf in one expert's weights reaches only that expert's tokens; NaN/Inf in token 0
    (the source of every padding slot) reaches only token 0 and its experts. Forward and all
    gradients, against a float64 loop (same non-finite pattern, same finite values)."""
    x, plan, w_gate_up, w_down, grad_out = _routed_problem()
    args = {"x": x, "w_gate_up": w_gate_up, "w_down": w_down}
    args[where] = args[where].at[index].set(value)
    x, w_gate_up, w_down = args["x"], args["w_gate_up"], args["w_down"]
    assert int(plan.group_sizes.max()) < 128  # every group ends in padding slots of its tile

    def f(x, scores, w_gate_up, w_down):
        return PATHS[path](x, plan.with_scores(scores), w_gate_up, w_down)

    out, vjp = jax.vjp(f, x, plan.scores, w_gate_up, w_down)
    dx, d_scores, dw1, dw2 = vjp(grad_out)
    want = reference_moe(x, plan, w_gate_up, w_down, grad_out)
    for name, got, ref in zip(("out", "dx", "d_scores", "dw_gate_up", "dw_down"),
                              (out, dx, d_scores, dw1, dw2), want):
        assert_same_nonfinite_and_close(got, ref, name)
    # The reference really confines it: the other tokens and experts are finite.
    assert np.isfinite(want[0]).all(axis=1).sum() >= T // 3
    assert np.isfinite(want[3]).all(axis=(1, 2)).sum() >= 2


# ------------------------------------------------------------ routing never divides 0 by 0


@pytest.mark.parametrize("make_plan", [
    lambda l: pm.routing.topk_plan(l, 2, score="sigmoid", renormalize=True),
    lambda l: pm.routing.token_rounding_plan(l, 2, tile=2, rounding="up", score="sigmoid", renormalize=True),
])
def test_sigmoid_renormalize_with_underflowing_scores(make_plan):
    """Logits <= -90: every sigmoid underflows in f32, and p / sum(p) was 0/0 = NaN."""
    logits = np.array(
        [[-100.0, -95.0, -120.0, -110.0], [-90.0, -91.0, -92.0, -150.0], [0.5, -1.0, 2.0, 0.0]],
        np.float32,
    )
    plan = make_plan(jnp.asarray(logits))
    scores = np.asarray(plan.scores)
    assert np.isfinite(scores).all(), scores
    # float64 reference: a token's top-2 rows carry their sigmoid renormalized over the two;
    # rows token rounding adds carry the plain sigmoid.
    p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    tok, sizes = np.asarray(plan.token_ids), np.asarray(plan.group_sizes)
    expert = np.repeat(np.arange(4), sizes)
    top_rows = 0
    for r, (t, e) in enumerate(zip(tok, expert)):
        top = np.argsort(-p[t])[:2]
        if e in top:
            top_rows += 1
            np.testing.assert_allclose(scores[r], p[t, e] / p[t, top].sum(), rtol=1e-5)
        else:
            np.testing.assert_allclose(scores[r], p[t, e], rtol=1e-5, atol=1e-30)
    assert top_rows == 6  # every token-choice row ("up" drops none)
    grads = jax.grad(lambda l: jnp.sum(make_plan(l).scores ** 2))(jnp.asarray(logits))
    assert np.isfinite(np.asarray(grads)).all()


# ------------------------------------------------------------ non-finite bias or rate is an error


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_selection_bias_is_named(bad):
    logits = jax.random.normal(jax.random.key(0), (8, 4))
    bias = jnp.zeros((4,)).at[2].set(bad)
    with pytest.raises(ValueError, match="bias contains NaN or Inf"):
        pm.routing.topk_plan(logits, 2, score="sigmoid", bias=bias)
    with pytest.raises(ValueError, match="bias contains NaN or Inf"):
        pm.routing.token_rounding_plan(logits, 2, tile=2, score="sigmoid", bias=bias)
    f = jax.jit(checkify.checkify(
        lambda l, b: pm.routing.topk_plan(l, 2, score="sigmoid", bias=b, check_finite=True).scores
    ))
    err, _ = f(logits, bias)
    with pytest.raises(checkify.JaxRuntimeError, match="bias contains 1 NaN or Inf"):
        err.throw()

    layer = pm.nn.MoE(8, 4, 4, 2, score="sigmoid", selection_bias=True, backend="xla", rngs=nnx.Rngs(0))
    layer.selection_bias[...] = bias
    with pytest.raises(ValueError, match="bias contains NaN or Inf"):
        layer(jnp.ones((3, 8)))


@pytest.mark.parametrize("rate", [np.nan, np.inf, -1.0])
def test_nonfinite_bias_rate_is_named(rate):
    layer = pm.nn.MoE(8, 4, 4, 2, score="sigmoid", selection_bias=True, backend="xla", rngs=nnx.Rngs(0))
    _, aux = layer(jnp.ones((3, 8)))
    before = np.asarray(layer.selection_bias[...])
    with pytest.raises(ValueError, match="rate must be"):
        layer.update_bias(aux, rate=rate)
    np.testing.assert_array_equal(np.asarray(layer.selection_bias[...]), before)  # untouched
    with pytest.raises(ValueError, match="rate must be"):
        pm.routing.update_selection_bias(jnp.zeros(4), aux["tc_counts"], rate)
    with pytest.raises(ValueError, match="bias_update_rate must be"):
        pm.nn.MoE(8, 4, 4, 2, score="sigmoid", selection_bias=True, bias_update_rate=rate, rngs=nnx.Rngs(0))


# ------------------------------------------------------------ NaN in a layer's x is reported as x


def _layer(**kwargs):
    return pm.nn.MoE(8, 4, 4, 2, backend="xla", rngs=nnx.Rngs(0), **kwargs)


def test_nan_in_x_is_reported_as_x():
    layer = _layer()
    x = jax.random.normal(jax.random.key(1), (2, 5, 8)).at[1, 3, 2].set(jnp.nan)
    with pytest.raises(ValueError, match="^x contains NaN or Inf"):
        layer(x)

    # Under jit: checkify when asked, naming x (not the logits the NaN reaches next) ...
    checked = _layer(check_finite=True)
    f = jax.jit(checkify.checkify(lambda m, x: m(x)[0]))
    err, _ = f(checked, x)
    with pytest.raises(checkify.JaxRuntimeError, match="^x contains 1 NaN or Inf"):
        err.throw()
    err, _ = f(checked, jnp.nan_to_num(x))
    err.throw()  # finite: no error
    # ... and by default no check inside the step, but a flag in aux to read after it.
    _, aux = nnx.jit(lambda m, x: m(x))(layer, x)
    assert int(aux["nonfinite_tokens"]) == 1
    _, aux = nnx.jit(lambda m, x: m(x))(layer, jnp.nan_to_num(x))
    assert int(aux["nonfinite_tokens"]) == 0
    # Nothing checks when asked not to.
    y, _ = _layer(check_finite=False)(x)
    assert np.isnan(np.asarray(y)[1, 3]).any()


def test_nonfinite_router_is_reported_as_router():
    layer = _layer()
    layer.router[...] = layer.router[...].at[0, 1].set(jnp.inf)
    with pytest.raises(ValueError, match="^router contains NaN or Inf"):
        layer(jnp.ones((3, 8)))


# ------------------------------------------------------------ backend="mosaic" without Hopper


@pytest.mark.skipif(ON_HOPPER, reason="checks the error on machines without a Hopper GPU")
def test_mosaic_backend_without_hopper_is_a_clear_error():
    x, plan, w_gate_up, w_down, _ = _routed_problem()
    x, w_gate_up, w_down = (a.astype(jnp.bfloat16) for a in (x, w_gate_up, w_down))
    with pytest.raises(ValueError, match="backend='mosaic' needs a Hopper GPU.*'interpret'"):
        pm.moe_ffn(x, plan, w_gate_up, w_down, backend="mosaic")
    layer = pm.nn.MoE(8, 4, 4, 2, backend="mosaic", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="backend='mosaic' needs a Hopper GPU"):
        layer(jnp.ones((3, 8)))
    assert resolve_backend("auto", x, w_down) == "xla"


# ------------------------------------------------------------ NumPy float64 input


def test_moe_on_numpy_float64():
    layer = _layer()
    x64 = np.random.default_rng(0).normal(size=(2, 5, 8))  # float64
    y, aux = layer(x64)
    want, _ = layer(jnp.asarray(x64, jnp.float32))
    assert y.dtype == jnp.float32 and y.shape == x64.shape
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    y16, _ = _layer(dtype=jnp.bfloat16)(x64)
    assert y16.dtype == jnp.bfloat16


# ------------------------------------------------------------ validate_plan


def _good_plan():
    logits = jax.random.normal(jax.random.key(3), (6, 4))
    return pm.routing.topk_plan(logits, 2)


def _bad_plans():
    plan = _good_plan()
    rows = int(plan.num_rows)
    yield "token id", dataclasses.replace(plan, token_ids=plan.token_ids.at[1].set(6)), "plan.token_ids: 1 real rows"
    yield "negative token id", dataclasses.replace(plan, token_ids=plan.token_ids.at[0].set(-1)), "plan.token_ids"
    yield "sizes past P", dataclasses.replace(plan, group_sizes=plan.group_sizes.at[2].add(1)), \
        "group_sizes sum to 13 rows, past the plan's row capacity P=12"
    sizes = plan.group_sizes.at[0].set(-1).at[1].add(plan.group_sizes[0] + 1)  # same sum
    yield "negative size", dataclasses.replace(plan, group_sizes=sizes), "group_sizes must be >= 0, got a minimum of -1"
    yield "nan score", dataclasses.replace(plan, scores=plan.scores.at[rows - 1].set(jnp.nan)), "plan.scores: 1 real rows"
    yield "offsets", dataclasses.replace(
        plan, token_row_offsets=plan.token_row_offsets.at[3].set(99)), "plan.token_row_offsets"
    yield "rows twice", dataclasses.replace(
        plan, rows_by_token=plan.rows_by_token.at[0].set(plan.rows_by_token[1])), "plan.rows_by_token must list"
    swapped = plan.rows_by_token.at[0].set(plan.rows_by_token[1]).at[1].set(plan.rows_by_token[0])
    yield "expert order", dataclasses.replace(plan, rows_by_token=swapped), "ascending expert order"
    yield "wrong token", dataclasses.replace(
        plan, rows_by_token=plan.rows_by_token.at[0].set(plan.rows_by_token[2]).at[2].set(plan.rows_by_token[0])
    ), "point at rows of another token"


def test_validate_plan_accepts_router_plans():
    logits = jax.random.normal(jax.random.key(4), (32, 8))
    pm.routing.validate_plan(pm.routing.topk_plan(logits, 3), 32)
    pm.routing.validate_plan(pm.routing.token_rounding_plan(logits, 2, tile=4, rounding="up"), 32)
    pm.routing.validate_plan(pm.routing.token_rounding_plan(logits, 2, tile=4, rounding="down"), 32)
    with pytest.raises(ValueError, match="plan.token_row_offsets must have shape"):
        pm.routing.validate_plan(_good_plan(), 7)


@pytest.mark.parametrize("case", list(range(9)))
def test_validate_plan_names_what_is_wrong(case):
    name, plan, match = list(_bad_plans())[case]
    x = jnp.ones((6, 8))
    w_gate_up, w_down = jnp.ones((4, 8, 8)) * 0.1, jnp.ones((4, 4, 8)) * 0.1
    with pytest.raises(ValueError, match=match):
        pm.routing.validate_plan(plan, 6)
    with pytest.raises(ValueError, match=match):
        pm.moe_ffn(x, plan, w_gate_up, w_down, backend="xla", validate=True)
    f = jax.jit(checkify.checkify(lambda p: pm.moe_ffn(x, p, w_gate_up, w_down, backend="xla", validate=True)))
    err, _ = f(plan)
    with pytest.raises(checkify.JaxRuntimeError, match=match):
        err.throw()
    err, _ = f(_good_plan())
    err.throw()


# ------------------------------------------------------------ NaN in one shard's tokens under EP


def test_nan_in_one_shard_under_expert_parallelism_ends_in_bounded_time():
    """8 CPU devices: a NaN in one expert shard's tokens is reported (by name, or in aux
    after the step) on every path; no shard waits forever on another. The subprocess is
    killed after 600 s, so a hang fails the test instead of hanging the suite."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ep_nan_check"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {r["case"] for r in results} == {
        "eager_x", "checkify_x", "checkify_logits_in_shard_map", "aux_flag_all_gather", "aux_flag_ragged",
    }, proc.stdout
    bad = [r for r in results if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)
