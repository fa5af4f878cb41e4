"""The `xla` backend of moe_ffn against an independent naive per-token loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe as pm


def naive_moe(x, w_gate_up, w_down, selected, weights):
    """Per-token loop in float64 numpy: O[t] = sum_e w[t,e] * swiglu(x[t] W1[e]) W2[e]."""
    x, w1, w2 = (np.asarray(a, np.float64) for a in (x, w_gate_up, w_down))
    n = w2.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e in range(w1.shape[0]):
            if selected[t, e]:
                h = x[t] @ w1[e]
                a = h[:n] / (1 + np.exp(-h[:n])) * h[n:]
                out[t] += weights[t, e] * (a @ w2[e])
    return out


def dense_moe(x, w_gate_up, w_down, logits, mask):
    """Dense jnp MoE over every expert, masked: an autodiff oracle independent of the plan."""
    n = w_down.shape[1]
    weights = jax.nn.softmax(logits, -1) * mask  # [T, E]
    h = jnp.einsum("td,edf->tef", x, w_gate_up)  # [T, E, 2n]
    a = jax.nn.silu(h[..., :n]) * h[..., n:]  # [T, E, n]
    y = jnp.einsum("ten,end->ted", a, w_down)  # [T, E, d]
    return jnp.einsum("te,ted->td", weights, y)


def make_inputs(seed, num_tokens, d, n, num_experts, skew=0.0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 4)
    logits = jax.random.normal(k[0], (num_tokens, num_experts))
    logits = logits.at[:, 0].add(skew)
    x = jax.random.normal(k[1], (num_tokens, d), dtype)
    w1 = (jax.random.normal(k[2], (num_experts, d, 2 * n)) / np.sqrt(d)).astype(dtype)
    w2 = (jax.random.normal(k[3], (num_experts, n, d)) / np.sqrt(n)).astype(dtype)
    return logits, x, w1, w2


@pytest.mark.parametrize(
    "num_tokens, d, n, num_experts, k, skew",
    [
        (37, 16, 8, 6, 2, 0.0),  # ragged groups
        (50, 8, 4, 1, 1, 0.0),  # E = 1
        (64, 16, 8, 8, 1, 0.0),  # K = 1
        (40, 8, 8, 5, 2, 20.0),  # one expert holds all tokens, others nearly empty
        (300, 8, 4, 4, 2, 0.0),  # groups larger than one xla tile (128 rows)
    ],
)
def test_topk_forward_matches_naive(num_tokens, d, n, num_experts, k, skew):
    logits, x, w1, w2 = make_inputs(0, num_tokens, d, n, num_experts, skew)
    plan = pm.routing.topk_plan(logits, k)
    selected, weights = pm.routing.topk_assignment(logits, k)
    got = pm.moe_ffn(x, plan, w1, w2, backend="xla")
    ref = naive_moe(x, w1, w2, np.asarray(selected), np.asarray(weights))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("rounding", ["nearest", "up", "down"])
def test_token_rounding_forward_matches_naive(rounding):
    logits, x, w1, w2 = make_inputs(1, 45, 8, 8, 6, skew=1.0)
    plan = pm.routing.token_rounding_plan(logits, 2, tile=4, rounding=rounding)
    selected, weights, _ = pm.routing.token_rounding_assignment(logits, 2, tile=4, rounding=rounding)
    assert int(plan.num_rows) < plan.capacity  # padding rows present
    got = pm.moe_ffn(x, plan, w1, w2, backend="xla")
    ref = naive_moe(x, w1, w2, np.asarray(selected), np.asarray(weights))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("skew", [0.0, 6.0])
def test_gradients_match_dense_oracle(skew):
    num_tokens, d, n, num_experts, k = 33, 8, 8, 5, 2
    logits, x, w1, w2 = make_inputs(2, num_tokens, d, n, num_experts, skew)
    cotangent = jax.random.normal(jax.random.key(9), (num_tokens, d))
    mask = np.asarray(pm.routing.topk_assignment(logits, k)[0], np.float32)

    def loss(logits, x, w1, w2):
        plan = pm.routing.topk_plan(logits, k)
        return jnp.sum(pm.moe_ffn(x, plan, w1, w2, backend="xla") * cotangent)

    def ref_loss(logits, x, w1, w2):
        return jnp.sum(dense_moe(x, w1, w2, logits, mask) * cotangent)

    got = jax.grad(loss, argnums=(0, 1, 2, 3))(logits, x, w1, w2)
    ref = jax.grad(ref_loss, argnums=(0, 1, 2, 3))(logits, x, w1, w2)
    for name, g, r in zip(["logits", "x", "w_gate_up", "w_down"], got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5, err_msg=name)


def test_bf16_forward_close_to_naive():
    logits, x, w1, w2 = make_inputs(3, 64, 32, 16, 4, dtype=jnp.bfloat16)
    plan = pm.routing.topk_plan(logits, 2)
    selected, weights = pm.routing.topk_assignment(logits, 2)
    got = np.asarray(pm.moe_ffn(x, plan, w1, w2, backend="xla"), np.float64)
    ref = naive_moe(x, w1, w2, np.asarray(selected), np.asarray(weights))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_forward_is_jittable_and_never_builds_expert_by_row_arrays():
    num_tokens, d, n, num_experts, k = 256, 64, 32, 16, 4
    logits, x, w1, w2 = make_inputs(4, num_tokens, d, n, num_experts)
    f = jax.jit(lambda l, x, a, b: pm.moe_ffn(x, pm.routing.topk_plan(l, k), a, b, backend="xla"))
    hlo = f.lower(logits, x, w1, w2).as_text()
    p = num_tokens * k
    assert f"{num_experts},{p},{d}" not in hlo and "ragged-dot" not in hlo and "ragged_dot" not in hlo
    assert f(logits, x, w1, w2).shape == (num_tokens, d)


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(x=jnp.zeros((10, 8))), "plan was built for T=12"),
        (dict(w_gate_up=jnp.zeros((4, 8, 8))), "w_gate_up has 4 experts"),
        (dict(w_gate_up=jnp.zeros((3, 6, 8))), r"w_gate_up must be \[E, d, 2n\]"),
        (dict(w_gate_up=jnp.zeros((3, 8, 7))), "must be 2n"),
        (dict(w_down=jnp.zeros((3, 4, 6))), r"w_down must be \[E, n, d\]"),
        (dict(w_down=jnp.zeros((3, 4, 8), jnp.bfloat16)), "must share one dtype"),
        (dict(x=jnp.zeros((12, 8), jnp.int32)), "x must be a floating"),
        (dict(backend="cuda"), "backend must be one of"),
    ],
)
def test_bad_moe_input_errors(args, match):
    base = dict(x=jnp.zeros((12, 8)), w_gate_up=jnp.zeros((3, 8, 8)), w_down=jnp.zeros((3, 4, 8)), backend="xla")
    base.update(args)
    plan = pm.routing.topk_plan(jnp.zeros((12, 3)), 2)
    with pytest.raises((ValueError, TypeError), match=match):
        pm.moe_ffn(base["x"], plan, base["w_gate_up"], base["w_down"], backend=base["backend"])


def test_auto_backend_picks_kernels_only_where_they_apply(monkeypatch):
    from pallas_moe.ops import moe_ffn as moe_ffn_module

    class FakeHopper:
        platform, compute_capability = "gpu", "9.0"

    bf16 = lambda *s: jnp.zeros(s, jnp.bfloat16)
    resolve = moe_ffn_module.resolve_backend
    assert resolve("auto", bf16(4, 128), bf16(2, 64, 128)) == "xla"  # CPU here
    monkeypatch.setattr(moe_ffn_module.jax, "devices", lambda: [FakeHopper()])
    assert resolve("auto", bf16(4, 128), bf16(2, 64, 128)) == "mosaic"
    assert resolve("auto", jnp.zeros((4, 128)), jnp.zeros((2, 64, 128))) == "xla"  # f32
    assert resolve("auto", bf16(4, 96), bf16(2, 64, 96)) == "xla"  # d not a multiple of 64
    assert resolve("xla", bf16(4, 128), bf16(2, 64, 128)) == "xla"
