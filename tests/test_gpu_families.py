"""GPU-only checks of model-family options on the real `mosaic` backend (`pytest -m gpu`).

* gpt-oss at its real width (d = n = 2880, E = 32, K = 4, T = 4096, bf16): expert biases on
  both projections and the clamped SwiGLU, in the kernels' epilogues (forward and backward),
  against the `xla` backend: forward and every gradient, on poisoned device memory, and
  bitwise run-to-run.
* DeepSeek-V3 routing (grouped top-K, sigmoid score with a selection bias,
  `routed_scaling_factor`) through `pm.nn.MoE.from_hf_config` at the real width (d = 7168,
  n = 2048, E = 256, K = 8), `mosaic` vs `xla`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_moe as pm

from tests.test_gpu import _poison, on_hopper, rel_err
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs a Hopper GPU")]


GPT_OSS = (4096, 2880, 2880, 32, 4)  # T, d, n, E, K at gpt-oss's width


def gpt_oss_inputs(seed, clamped, cot_dtype):
    """(activation, logits [T, E] skewed to 3 experts, x, w1, w2, b1, b2, cotangent [T, d]
    in `cot_dtype`) at `GPT_OSS`; H ~ N(b1, 16), so the clamps at +-7 are active on a few
    percent of the elements."""
    num_tokens, d, n, num_experts, _ = GPT_OSS
    act = pm.ops.activation.SwiGLU.clamped(alpha=1.702, limit=7.0) if clamped else pm.ops.activation.SwiGLU()
    ks = jax.random.split(jax.random.key(seed), 7)
    logits = jax.random.normal(ks[0], (num_tokens, num_experts)).at[:, :3].add(1.0)
    x = jax.random.normal(ks[1], (num_tokens, d), jnp.bfloat16)
    w1 = (jax.random.normal(ks[2], (num_experts, d, 2 * n)) * 4 * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (num_experts, n, d)) * n**-0.5).astype(jnp.bfloat16)
    b1 = jax.random.normal(ks[4], (num_experts, 2 * n), jnp.bfloat16)
    b2 = jax.random.normal(ks[5], (num_experts, d), jnp.bfloat16)
    cot = jax.random.normal(ks[6], (num_tokens, d), cot_dtype)
    return act, logits, x, w1, w2, b1, b2, cot


@pytest.mark.parametrize("router, clamped", [("topk", False), ("token_rounding", True)])
def test_gpt_oss_width_biases_and_clamped_swiglu_mosaic_matches_xla(router, clamped):
    num_tokens, d, n, num_experts, k = GPT_OSS
    act, logits, x, w1, w2, b1, b2, cot = gpt_oss_inputs(12, clamped, jnp.float32)
    make_plan = {
        "topk": lambda l: pm.routing.topk_plan(l, k),
        "token_rounding": lambda l: pm.routing.token_rounding_plan(l, k, tile=128, rounding="nearest"),
    }[router]

    def step(backend):
        def loss(logits, x, w1, w2, b1, b2):
            out = pm.moe_ffn(x, make_plan(logits), w1, w2, b_gate_up=b1, b_down=b2,
                             activation=act, backend=backend)
            return jnp.sum(out.astype(jnp.float32) * cot), out

        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))

    args = (logits, x, w1, w2, b1, b2)
    mosaic = step("mosaic")
    _poison(num_tokens * k * 2 * n * 2 * 3)
    (_, out), grads = mosaic(*args)
    (_, ref_out), ref_grads = step("xla")(*args)
    plan = make_plan(logits)
    h = jnp.einsum("td,df->tf", x[:256], w1[0], preferred_element_type=jnp.float32) + b1[0]
    assert float(jnp.mean(h[:, :n] > 7.0)) > 0.01 and float(jnp.mean(jnp.abs(h[:, n:]) > 7.0)) > 0.01
    assert rel_err(out, ref_out) < 1e-2
    names = ["logits", "x", "w_gate_up", "w_down", "b_gate_up", "b_down"]
    for name, g in zip(names, grads):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
    # With the clamp the gradients are not compared with the xla backend's: H differs from
    # XLA's in the last bf16 bit (another fp32 accumulation order), and an element of H
    # within one ulp of a clamp (+-7) then flips between a zero and a full derivative
    # (measured on the H100, session 4: 2.8% on dx). The clamped backward is checked exactly
    # by `test_gpt_oss_width_kernel_backward_matches_jnp_on_the_same_h`.
    if not clamped:
        for name, g, r in zip(names, grads, ref_grads):
            assert rel_err(g, r) < 2e-2, (name, rel_err(g, r))
    assert int(plan.num_rows) > 0
    _poison(num_tokens * k * 2 * n * 2 * 3)
    (_, again), grads_again = mosaic(*args)
    assert bool(jnp.array_equal(out, again)), "the forward must be bitwise reproducible"
    for name, g, g2 in zip(names, grads, grads_again):
        assert bool(jnp.array_equal(g, g2)), f"{name}: gradients must be bitwise reproducible"


@pytest.mark.parametrize("clamped", [True, False])
def test_gpt_oss_width_kernel_backward_matches_jnp_on_the_same_h(clamped):
    """The kernels' backward with expert biases (and the clamped SwiGLU) against the jnp
    minimal backward, both from the same saved H (the kernel forward's own), so every clamp
    decision is the same on both sides: dx, d_scores, both weight and both bias gradients."""
    from pallas_moe.kernels.moe_backward import moe_backward
    from pallas_moe.kernels.moe_forward import moe_forward
    from pallas_moe.ops.minimal_backward import moe_ffn_backward

    _, d, n, _, k = GPT_OSS
    act, logits, x, w1, w2, b1, b2, go = gpt_oss_inputs(13, clamped, jnp.bfloat16)
    plan = pm.routing.topk_plan(logits, k)
    _, h = jax.jit(lambda *a: moe_forward(*a, b_gate_up=b1, b_down=b2, activation=act))(x, plan, w1, w2)
    _poison(plan.capacity * (5 * n + d) * 2)
    got = jax.jit(lambda *a: moe_backward(*a, activation=act, b_down=b2))(x, h, plan, w1, w2, go)
    ref = jax.jit(lambda *a: moe_ffn_backward(*a, activation=act, b_down=b2))(x, h, plan, w1, w2, go)
    names = ("dx", "d_scores", "dw_gate_up", "dw_down", "db_gate_up", "db_down")
    assert len(got) == len(ref) == len(names)
    for name, g, r in zip(names, got, ref):
        assert bool(jnp.all(jnp.isfinite(jnp.asarray(g, jnp.float32)))), name
        assert rel_err(g, r) < 2e-2, (name, rel_err(g, r))


DEEPSEEK_V3 = dict(  # the MoE fields of DeepSeek-V3's config.json
    model_type="deepseek_v3", hidden_size=7168, moe_intermediate_size=2048,
    n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
    routed_scaling_factor=2.5, n_shared_experts=1, scoring_func="sigmoid",
    topk_method="noaux_tc", hidden_act="silu",
)


def test_deepseek_v3_routing_at_real_width_mosaic_matches_xla():
    """Grouped top-K over sigmoid scores with a selection bias, routed_scaling_factor, the
    shared expert: the module on `mosaic` vs `xla` (same parameters), output and gradients
    (x, router, every parameter), at DeepSeek-V3's widths (d=7168, n=2048, 8 groups, top-4
    groups, K=8). The expert count is 64 instead of 256 (8 per group instead of 32): with
    256 the `xla` reference's fp32 temporaries ran out of the H100's memory (session 4).
    The weight gradients are compared expert block by expert block from the host."""
    num_tokens = 512
    layer = pm.nn.MoE.from_hf_config(
        {**DEEPSEEK_V3, "n_routed_experts": 64}, rngs=nnx.Rngs(0), backend="mosaic",
        dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16,
    )
    layer.selection_bias[...] = 0.1 * jax.random.normal(jax.random.key(1), layer.selection_bias.shape)
    x = jax.random.normal(jax.random.key(2), (num_tokens, 7168), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(3), (num_tokens, 7168), jnp.float32)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def step(backend):
        def loss(params, x):
            model = nnx.merge(graphdef, params, rest)
            model.backend = backend
            y, _ = model(x)
            return jnp.sum(y.astype(jnp.float32) * cot), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    (_, out), (g_params, g_x) = step("mosaic")(params, x)
    host = jax.device_get(g_params)  # free the device for the xla run
    del g_params
    (_, ref_out), (r_params, r_x) = step("xla")(params, x)
    assert rel_err(out, ref_out) < 1e-2
    assert rel_err(g_x, r_x) < 2e-2
    errors = {}

    def compare(path, got, want):
        got, want = np.asarray(got), jnp.asarray(want)
        assert np.all(np.isfinite(got.astype(np.float32).ravel()[:1_000_000])), path
        rows = max(1, (1 << 28) // max(1, got[0].size * 4))  # a float32 copy of `rows` fits
        num = den = 0.0
        for i in range(0, got.shape[0], rows):
            g = jnp.asarray(got[i:i + rows], jnp.float32)
            r = want[i:i + rows].astype(jnp.float32)
            num += float(jnp.sum((g - r) ** 2))
            den += float(jnp.sum(r**2))
        errors[jax.tree_util.keystr(path)] = (num / max(den, 1e-30)) ** 0.5

    jax.tree_util.tree_map_with_path(compare, host, r_params)
    assert errors and all(err < 2e-2 for err in errors.values()), errors
