"""The minimal-residual custom_vjp of moe_ffn, checked with the jnp reference forward.

The kernels' own gradients are checked in the kernel tests; this file checks the backward
math (`docs/math.md`) and the residual-memory contract independently of any kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe as pm
from pallas_moe.kernels.reference import moe_forward_reference
from pallas_moe.ops.mosaic import minimal_residual_moe_ffn

moe_minimal = minimal_residual_moe_ffn(moe_forward_reference)


def make_inputs(seed, num_tokens, d, n, num_experts, skew=0.0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 5)
    logits = jax.random.normal(k[0], (num_tokens, num_experts)).at[:, 0].add(skew)
    x = jax.random.normal(k[1], (num_tokens, d)).astype(dtype)
    w1 = (jax.random.normal(k[2], (num_experts, d, 2 * n)) / np.sqrt(d)).astype(dtype)
    w2 = (jax.random.normal(k[3], (num_experts, n, d)) / np.sqrt(n)).astype(dtype)
    cot = jax.random.normal(k[4], (num_tokens, d)).astype(dtype)
    return logits, x, w1, w2, cot


def routed(moe, router):
    def loss(logits, x, w1, w2, cot):
        return jnp.sum(moe(x, router(logits), w1, w2).astype(jnp.float32) * cot)

    return jax.grad(loss, argnums=(0, 1, 2, 3))


ROUTERS = {
    "topk": lambda l: pm.routing.topk_plan(l, 2),
    "topk_softmax": lambda l: pm.routing.topk_plan(l, 2, score="topk_softmax"),
    "sigmoid": lambda l: pm.routing.topk_plan(l, 2, score="sigmoid", renormalize=True),
    "token_rounding": lambda l: pm.routing.token_rounding_plan(l, 2, tile=4, rounding="nearest"),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("skew", [0.0, 8.0])
def test_minimal_backward_matches_autodiff(router, skew):
    logits, x, w1, w2, cot = make_inputs(0, 41, 16, 8, 6, skew)
    xla = lambda x, plan, a, b: pm.moe_ffn(x, plan, a, b, backend="xla")
    got = routed(moe_minimal, ROUTERS[router])(logits, x, w1, w2, cot)
    ref = routed(xla, ROUTERS[router])(logits, x, w1, w2, cot)
    for name, g, r in zip(["logits", "x", "w_gate_up", "w_down"], got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5, err_msg=name)


def test_empty_experts_get_zero_weight_gradients():
    logits, x, w1, w2, cot = make_inputs(1, 24, 8, 8, 5)
    logits = logits.at[:, 3].set(-1e4)  # expert 3 never chosen
    _, _, dw1, dw2 = routed(moe_minimal, ROUTERS["topk"])(logits, x, w1, w2, cot)
    assert not np.any(np.asarray(dw1[3])) and not np.any(np.asarray(dw2[3]))


def test_bf16_backward_close_to_fp32():
    logits, x, w1, w2, cot = make_inputs(2, 64, 32, 16, 4, dtype=jnp.bfloat16)
    got = routed(moe_minimal, ROUTERS["topk"])(logits, x, w1, w2, cot)
    f32 = lambda a: a.astype(jnp.float32)
    xla = lambda x, plan, a, b: pm.moe_ffn(x, plan, a, b, backend="xla")
    ref = routed(xla, ROUTERS["topk"])(logits, f32(x), f32(w1), f32(w2), f32(cot))
    for name, g, r in zip(["logits", "x", "w_gate_up", "w_down"], got, ref):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2, name


def residual_bytes(moe, num_tokens=64, d=48, n=16, num_experts=8, k=4):
    """Bytes of the vjp's residuals that are not inputs, and the shapes of all residuals."""
    logits, x, w1, w2, _ = make_inputs(3, num_tokens, d, n, num_experts, dtype=jnp.bfloat16)
    plan = pm.routing.topk_plan(logits, k)
    inputs = [x, w1, w2, *jax.tree.leaves(plan)]
    _, vjp_fn = jax.vjp(lambda x, w1, w2, s: moe(x, plan.with_scores(s), w1, w2), x, w1, w2, plan.scores)
    leaves = [l for l in jax.tree.leaves(vjp_fn) if hasattr(l, "nbytes")]
    new = [l for l in leaves if not any(l is i for i in inputs)]
    return sum(l.nbytes for l in new), [l.shape for l in new], plan.capacity


def test_residuals_are_at_the_floor():
    num_tokens, d, n = 64, 48, 16  # d != 2n, so a [P, d] residual can't pass for H [P, 2n]
    nbytes, shapes, capacity = residual_bytes(moe_minimal, num_tokens, d, n)
    floor = 2 * num_tokens * d + 4 * capacity * n + 16 * capacity
    assert nbytes <= floor, (nbytes, floor, shapes)
    # Neither Y nor a gathered X ([P, d]) may ever be saved.
    assert (capacity, d) not in shapes, shapes


def test_residual_check_can_fail():
    # Plain autodiff of the xla path saves gathered X tiles: the same check must catch it.
    xla = lambda x, plan, a, b: pm.moe_ffn(x, plan, a, b, backend="xla")
    nbytes, shapes, capacity = residual_bytes(xla)
    assert nbytes > 2 * 64 * 48 + 4 * capacity * 16 + 16 * capacity


def test_under_jit_checkpoint_and_value_and_grad():
    logits, x, w1, w2, cot = make_inputs(4, 32, 8, 8, 4)

    @jax.jit
    def step(x, w1, w2):
        f = jax.checkpoint(lambda x, w1, w2: jnp.sum(moe_minimal(x, pm.routing.topk_plan(logits, 2), w1, w2) * cot))
        return jax.value_and_grad(f, argnums=(0, 1, 2))(x, w1, w2)

    val, grads = step(x, w1, w2)
    ref_val, ref_grads = jax.value_and_grad(
        lambda x, a, b: jnp.sum(pm.moe_ffn(x, pm.routing.topk_plan(logits, 2), a, b, backend="xla") * cot),
        argnums=(0, 1, 2),
    )(x, w1, w2)
    # The loss is a cancelling sum, so its error is measured against the sum of |terms|.
    scale = float(jnp.sum(jnp.abs(pm.moe_ffn(x, pm.routing.topk_plan(logits, 2), w1, w2, backend="xla") * cot)))
    np.testing.assert_allclose(val, ref_val, rtol=0, atol=1e-5 * scale)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)


def test_vmap_over_a_stack_of_layers():
    logits, x, w1, w2, cot = make_inputs(5, 32, 8, 8, 4)
    plan = pm.routing.topk_plan(logits, 2)
    w1s, w2s = jnp.stack([w1, 2 * w1]), jnp.stack([w2, -w2])  # [L, E, d, 2n], [L, E, n, d]
    loss = lambda moe: lambda a, b: jnp.sum(moe(x, plan, a, b) * cot)
    got = jax.vmap(jax.grad(loss(moe_minimal), argnums=(0, 1)))(w1s, w2s)
    xla = lambda x, plan, a, b: pm.moe_ffn(x, plan, a, b, backend="xla")
    ref = jax.vmap(jax.grad(loss(xla), argnums=(0, 1)))(w1s, w2s)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)


def test_backward_ignores_unwritten_padding_rows_of_h():
    # Token rounding "down" with tiny groups drops every row; the kernels leave H unwritten
    # (NaN in interpret mode), and the backward must still give finite, zero gradients.
    from pallas_moe.ops.minimal_backward import moe_ffn_backward

    logits, x, w1, w2, cot = make_inputs(6, 8, 8, 8, 4)
    plan = pm.routing.token_rounding_plan(logits, 1, tile=16, rounding="down")
    assert int(plan.num_rows) == 0
    h = jnp.full((plan.capacity, 16), jnp.nan, x.dtype)
    dx, ds, dw1, dw2 = moe_ffn_backward(x, h, plan, w1, w2, cot)
    for g in (dx, ds, dw1, dw2):
        assert not np.any(np.asarray(g)), "gradients of an empty plan must be exactly zero"


@pytest.mark.parametrize("router", ["topk", "token_rounding"])
def test_expert_bias_gradients_against_numpy(router):
    """`expert_bias_gradients` (db1, db2 and dS's b2 term as dense products) against a
    numpy loop over the plan's rows: ragged groups with an empty expert, token rounding's
    padding rows holding NaN in dH (and rows past P), bitwise the same on a second call."""
    from pallas_moe.ops.minimal_backward import expert_bias_gradients

    logits, _, _, _, cot = make_inputs(8, 40, 64, 16, 5, dtype=jnp.bfloat16)
    logits = logits.at[:, 3].add(-1e4)  # expert 3: no rows
    plan = ROUTERS[router](logits)
    num_rows, capacity = int(plan.num_rows), plan.capacity
    if router == "token_rounding":
        assert num_rows < capacity
    k = jax.random.split(jax.random.key(9), 2)
    pad = -(-capacity // 64) * 64
    dh = jax.random.normal(k[0], (pad, 32)).astype(jnp.bfloat16)
    dh = jnp.where((jnp.arange(pad) < num_rows)[:, None], dh, jnp.nan).astype(jnp.bfloat16)
    b_down = jax.random.normal(k[1], (5, 64)).astype(jnp.bfloat16)
    f = jax.jit(expert_bias_gradients)
    got = f(dh, plan, cot, b_down)
    again = f(dh, plan, cot, b_down)
    for g, a in zip(got, again):
        assert bool(jnp.array_equal(g, a))

    dh_np, do_np, b2_np = (np.asarray(a, np.float64) for a in (dh, cot, b_down))
    tok, s = np.asarray(plan.token_ids), np.asarray(plan.scores, np.float64)
    expert = np.repeat(np.arange(5), np.asarray(plan.group_sizes))
    want_ds = np.zeros(capacity)
    want_db1, want_db2 = np.zeros((5, 32)), np.zeros((5, 64))
    for r in range(num_rows):
        e = expert[r]
        want_ds[r] = do_np[tok[r]] @ b2_np[e]
        want_db1[e] += dh_np[r]
        want_db2[e] += s[r] * do_np[tok[r]]
    for name, g, w in (("dS_b", got[0], want_ds), ("db1", got[1], want_db1),
                       ("db2", got[2], want_db2)):
        assert g.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=name)
    assert not np.any(np.asarray(got[1][3])) and not np.any(np.asarray(got[2][3]))
    assert not np.any(np.asarray(got[0])[num_rows:])
