"""Hugging Face MoE families: `MoE.from_hf_config` + `convert.load_hf_moe` vs each family's math.

For every family, `reference_block` below is an independent implementation of the family's
MoE block written from its `transformers` modeling code (`modeling_<family>.py`): it reads
the checkpoint tensors under their Hugging Face names and PyTorch layouts directly
(`F.linear(x, W) = x @ W.T`), routes with the family's own recipe and loops over the K
chosen experts per token. It is generic over the array module: with numpy in float64 it
is the forward reference; with `jax.numpy` in float64 (`jax.enable_x64`) the same code is
differentiated by `jax.grad` to give the reference gradients (with respect to the input,
the router and every other checkpoint tensor).

The module runs in float32 on the `xla` backend; agreement is measured per tensor as
max|got - ref| / max|ref| and must be below 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_moe as pm
from pallas_moe.nn import convert
from pallas_moe.nn.families import FAMILY_NAMES, moe_kwargs_from_hf_config
from pallas_moe.ops.activation import SwiGLU

TOL = 1e-5
D, N = 16, 6  # d != n, d != 2n everywhere but gpt-oss, which uses d == n == 16 (as 2880 == 2880)

CONFIGS = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=D, moe_intermediate_size=N, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, hidden_act="silu", router_aux_loss_coef=0.001,
    ),
    "mixtral": dict(
        model_type="mixtral", hidden_size=D, intermediate_size=N, num_local_experts=8,
        num_experts_per_tok=2, hidden_act="silu", router_aux_loss_coef=0.02,
    ),
    "olmoe": dict(
        model_type="olmoe", hidden_size=D, intermediate_size=N, num_experts=8,
        num_experts_per_tok=4, norm_topk_prob=False, hidden_act="silu",
        router_aux_loss_coef=0.01, router_z_loss_coef=0.001,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=D, moe_intermediate_size=N, n_routed_experts=24,
        num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, n_shared_experts=2, scoring_func="sigmoid",
        topk_method="noaux_tc", hidden_act="silu",
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", hidden_size=D, moe_intermediate_size=N, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=12,
        hidden_act="silu",
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=D, intermediate_size=D, num_local_experts=8,
        num_experts_per_tok=2, swiglu_limit=7.0, router_aux_loss_coef=0.9,
    ),
}
LAYOUTS = {family: ("per_expert", "fused") for family in CONFIGS} | {"gpt_oss": ("fused",)}
CASES = [(family, layout) for family in CONFIGS for layout in LAYOUTS[family]]
PREFIX = "model.layers.1.mlp."


def widths(family):
    kw = moe_kwargs_from_hf_config(CONFIGS[family])
    return kw["num_experts"], kw["d_model"], kw["d_expert"]


def random_state_dict(family, layout, seed=0):
    """One MoE block's tensors under the family's HF names and layouts (float32 numpy)."""
    cfg = CONFIGS[family]
    num_experts, d, n = widths(family)
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)
    names = FAMILY_NAMES[family]
    sd = {names.router: normal(num_experts, d, scale=0.5)}
    if family == "gpt_oss":
        # Large enough that a good share of gate/up values pass the clamp at 7.
        sd["experts.gate_up_proj"] = normal(num_experts, d, 2 * n, scale=1.5)
        sd["experts.gate_up_proj_bias"] = normal(num_experts, 2 * n)
        sd["experts.down_proj"] = normal(num_experts, n, d, scale=n**-0.5)
        sd["experts.down_proj_bias"] = normal(num_experts, d)
        sd["router.bias"] = normal(num_experts)
    else:
        gate, up = normal(num_experts, n, d, scale=d**-0.5), normal(num_experts, n, d, scale=d**-0.5)
        down = normal(num_experts, d, n, scale=n**-0.5)
        if layout == "fused":  # transformers v5: gate_up_proj [E, 2n, d] (gate rows first), down [E, d, n]
            sd["experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            sd["experts.down_proj"] = down
        else:
            for e in range(num_experts):
                for name, w in zip(names.per_expert, (gate, up, down)):
                    sd[name.format(e=e)] = w[e]
    if names.selection_bias:
        # Non-negative, so HF's masked_fill(0.0) and the -inf masking pick the same experts.
        sd[names.selection_bias] = (0.1 * rng.random(num_experts)).astype(np.float32)
    if names.shared:
        m = cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts", 0) * n
        for name, shape in zip(names.shared, ((m, d), (m, d), (d, m))):
            sd[name] = normal(*shape, scale=shape[1] ** -0.5)
    if names.shared_gate:
        sd[names.shared_gate] = normal(1, d, scale=0.5)
    return {PREFIX + k: v for k, v in sd.items()}


# ---------------------------------------------------------------- the families' own math

def _linear(x, w, b=None):  # torch.nn.functional.linear: x @ w.T + b
    y = x @ w.T
    return y if b is None else y + b


def _sigmoid(xp, v):
    return 1 / (1 + xp.exp(-v))


def _softmax(xp, v):
    e = xp.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _topk(xp, v, k):
    idx = xp.argsort(-v, axis=-1)[:, :k]
    return xp.take_along_axis(v, idx, axis=-1), idx


def _torch_experts(xp, sd, family):
    """Stacked (gate [E, n, d], up [E, n, d], down [E, d, n]) as the block's forward reads them."""
    names = FAMILY_NAMES[family]
    if "experts.gate_up_proj" in sd:  # v5 fused: F.linear(x, gate_up_proj[e]).chunk(2, dim=-1)
        gate_up = sd["experts.gate_up_proj"]
        n = gate_up.shape[1] // 2
        return gate_up[:, :n], gate_up[:, n:], sd["experts.down_proj"]
    num_experts = sd[names.router].shape[0]
    return tuple(
        xp.stack([sd[name.format(e=e)] for e in range(num_experts)]) for name in names.per_expert
    )


def _mlp(xp, x, gate, up, down):  # Qwen2MoeMLP / DeepseekV3MLP: down(silu(gate(x)) * up(x))
    g = _linear(x, gate)
    return _linear(g * _sigmoid(xp, g) * _linear(x, up), down)


def reference_block(xp, family, sd, x):
    """The family's MoE block on x [T, d] with HF tensors `sd` (names without prefix)."""
    cfg = CONFIGS[family]
    k = cfg["num_experts_per_tok"]
    names = FAMILY_NAMES[family]
    shared = 0.0
    if family == "gpt_oss":  # GptOssTopKRouter + GptOssExperts
        logits = _linear(x, sd["router.weight"], sd["router.bias"])
        top_value, idx = _topk(xp, logits, k)
        weights = _softmax(xp, top_value)  # [T, K]
        w = sd["experts.gate_up_proj"][idx]  # [T, K, d, 2n]
        gate_up = xp.einsum("td,tkdf->tkf", x, w) + sd["experts.gate_up_proj_bias"][idx]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        limit, alpha = cfg["swiglu_limit"], 1.702
        gate = xp.where(gate > limit, limit, gate)  # clamp(max=limit)
        up = xp.where(up > limit, limit, xp.where(up < -limit, -limit, up))  # clamp(-limit, limit)
        glu = gate * _sigmoid(xp, gate * alpha)
        out = xp.einsum("tkn,tknd->tkd", (up + 1) * glu, sd["experts.down_proj"][idx])
        out = out + sd["experts.down_proj_bias"][idx]
        return xp.einsum("tk,tkd->td", weights, out)

    gate_w, up_w, down_w = _torch_experts(xp, sd, family)
    logits = _linear(x, sd[names.router])
    if family == "deepseek_v3":  # DeepseekV3TopkRouter.get_topk_indices + forward
        scores = _sigmoid(xp, logits)
        choice = scores + sd["gate.e_score_correction_bias"][None, :]
        num_tokens, num_experts = choice.shape
        groups = choice.reshape(num_tokens, cfg["n_group"], num_experts // cfg["n_group"])
        group_scores = xp.sort(groups, axis=-1)[..., -2:].sum(axis=-1)  # topk(2).sum
        _, group_idx = _topk(xp, group_scores, cfg["topk_group"])
        group_mask = (group_idx[:, :, None] == xp.arange(cfg["n_group"])[None, None, :]).any(axis=1)
        score_mask = xp.repeat(group_mask, num_experts // cfg["n_group"], axis=1)
        _, idx = _topk(xp, xp.where(score_mask, choice, 0.0), k)  # masked_fill(~mask, 0.0)
        weights = xp.take_along_axis(scores, idx, axis=-1)
        if cfg["norm_topk_prob"]:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        weights = weights * cfg["routed_scaling_factor"]
        shared = _mlp(xp, x, *(sd[name] for name in names.shared))
    else:  # Qwen3Moe / Olmoe / Qwen2Moe / Mixtral: softmax over E, top-K, optional renorm
        probs = _softmax(xp, logits)
        weights, idx = _topk(xp, probs, k)
        if family == "mixtral" or cfg["norm_topk_prob"]:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if family == "qwen2_moe":
            shared = _sigmoid(xp, _linear(x, sd["shared_expert_gate.weight"])) * _mlp(
                xp, x, *(sd[name] for name in names.shared)
            )
    g = xp.einsum("td,tknd->tkn", x, gate_w[idx])
    act = g * _sigmoid(xp, g) * xp.einsum("td,tknd->tkn", x, up_w[idx])
    out = xp.einsum("tkn,tkdn->tkd", act, down_w[idx])
    return xp.einsum("tk,tkd->td", weights, out) + shared


# ---------------------------------------------------------------------------- helpers

def load_layer(family, layout, sd, **kwargs):
    layer = pm.nn.MoE.from_hf_config(CONFIGS[family], rngs=nnx.Rngs(0), backend="xla", **kwargs)
    convert.load_hf_moe(layer, sd, family=family, prefix=PREFIX, layout=layout)
    return layer


def inputs(family, seed=1):
    _, d, _ = widths(family)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 9, d)).astype(np.float32)  # [B, S, d], T = 18
    cot = rng.standard_normal((2, 9, d)).astype(np.float32)
    return x, cot


def assert_close(got, ref, name):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    err = np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30)
    assert err < TOL, f"{name}: relative error {err:.2e} >= {TOL:.0e}"


def strip(sd):
    return {k[len(PREFIX):]: v for k, v in sd.items()}


def reference_grads(family, sd, x, cot):
    """jax.grad (float64) of sum(block(x) * cot) w.r.t. x and every checkpoint tensor."""
    with jax.enable_x64(True):
        params = {k: jnp.asarray(v, jnp.float64) for k, v in strip(sd).items()}
        loss = lambda p, x: jnp.sum(reference_block(jnp, family, p, x) * jnp.asarray(cot.reshape(-1, x.shape[-1]), jnp.float64))
        g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x.reshape(-1, x.shape[-1]), jnp.float64))
        return {PREFIX + k: np.asarray(v) for k, v in g_params.items()}, np.asarray(g_x).reshape(x.shape)


# ------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("family,layout", CASES)
def test_family_forward_and_gradients_match_the_reference(family, layout):
    sd = random_state_dict(family, layout)
    x, cot = inputs(family)
    layer = load_layer(family, layout, sd)

    ref = reference_block(np, family, {k: v.astype(np.float64) for k, v in strip(sd).items()},
                          x.reshape(-1, x.shape[-1]).astype(np.float64))
    y, _ = layer(jnp.asarray(x))
    assert y.dtype == jnp.float32 and y.shape == x.shape
    assert_close(y.reshape(-1, x.shape[-1]), ref, f"{family}/{layout} output")

    def loss(module, x):
        return jnp.sum(module(x)[0] * cot)

    g_layer, g_x = nnx.grad(loss, argnums=(0, 1))(layer, jnp.asarray(x))
    ref_sd_grads, ref_gx = reference_grads(family, sd, x, cot)
    assert_close(g_x, ref_gx, f"{family}/{layout} input gradient")
    assert_close(g_layer.router[...], ref_sd_grads[PREFIX + FAMILY_NAMES[family].router].T,
                 f"{family}/{layout} router gradient")
    # Every other parameter: the loader is a pure re-layout, so loading the reference's
    # gradients (as if they were weights) lays them out like the module's parameters.
    as_layer = load_layer(family, layout, ref_sd_grads)
    params = nnx.state(layer, nnx.Param)
    for path, _ in jax.tree_util.tree_leaves_with_path(params):
        name = path[0].key
        assert_close(getattr(g_layer, name)[...], getattr(as_layer, name)[...], f"{family}/{layout} d{name}")
    if family == "gpt_oss":  # the clamps are exercised on both sides
        gate_up = np.einsum("td,edf->tef", x.reshape(-1, D), sd[PREFIX + "experts.gate_up_proj"])
        assert np.mean(np.abs(gate_up) > 7.0) > 0.05


def test_from_hf_config_maps_each_family():
    expect = {
        "qwen3_moe": dict(d_expert=N, num_experts=8, top_k=3, score="softmax_topk", renormalize=True),
        "mixtral": dict(d_expert=N, num_experts=8, top_k=2, score="topk_softmax"),
        "olmoe": dict(top_k=4, renormalize=False, load_balance_weight=0.01, z_loss_weight=0.001),
        "deepseek_v3": dict(
            num_experts=24, score="sigmoid", renormalize=True, selection_bias=True, num_groups=4,
            topk_groups=2, routed_scaling_factor=2.5, num_shared_experts=2,
        ),
        "qwen2_moe": dict(num_shared_experts=1, d_shared=12, shared_expert_gate=True),
        "gpt_oss": dict(
            d_expert=D, score="topk_softmax", router_bias=True, expert_bias=True,
            activation=SwiGLU.clamped(1.702, 7.0), load_balance_weight=0.9,
        ),
    }
    for family, fields in expect.items():
        kwargs = moe_kwargs_from_hf_config(CONFIGS[family])
        assert {k: kwargs[k] for k in fields} == fields, family
        layer = pm.nn.MoE.from_hf_config(CONFIGS[family], rngs=nnx.Rngs(0))
        assert layer.config.top_k == CONFIGS[family]["num_experts_per_tok"]
    shared = pm.nn.MoE.from_hf_config(CONFIGS["deepseek_v3"], rngs=nnx.Rngs(0)).shared_down
    assert shared.shape == (2 * N, D)  # n_shared_experts * moe_intermediate_size


@pytest.mark.parametrize("change,match", [
    (dict(model_type="llama"), "family must be one of"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(num_experts_per_tok=None), "needs the field 'num_experts_per_tok'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(topk_group=5), "topk_groups=5 must be <= num_groups=4"),
])
def test_from_hf_config_errors(change, match):
    config = {**CONFIGS["deepseek_v3"], **change}
    with pytest.raises(ValueError, match=match):
        pm.nn.MoE.from_hf_config(config, rngs=nnx.Rngs(0))


def test_from_hf_config_family_and_kwargs():
    with pytest.raises(ValueError, match="family='mixtral' but config\\['model_type'\\] is 'olmoe'"):
        moe_kwargs_from_hf_config(CONFIGS["olmoe"], family="mixtral")
    no_type = {k: v for k, v in CONFIGS["olmoe"].items() if k != "model_type"}
    with pytest.raises(ValueError, match="no 'model_type'; pass family="):
        moe_kwargs_from_hf_config(no_type)
    assert moe_kwargs_from_hf_config(no_type, family="olmoe")["top_k"] == 4
    with pytest.raises(ValueError, match="\\['top_k'\\] come from the config"):
        pm.nn.MoE.from_hf_config(CONFIGS["olmoe"], rngs=nnx.Rngs(0), top_k=2)
    layer = pm.nn.MoE.from_hf_config(CONFIGS["olmoe"], rngs=nnx.Rngs(0), load_balance_weight=0.5, backend="xla")
    assert layer.config.load_balance_weight == 0.5 and layer.backend == "xla"


# ------------------------------------------------------------- wrong layouts are errors

def _expect_load_error(family, sd, match, layout=None, layer=None):
    layer = layer or pm.nn.MoE.from_hf_config(CONFIGS[family], rngs=nnx.Rngs(0))
    before = np.asarray(layer.router[...])
    with pytest.raises(ValueError, match=match):
        convert.load_hf_moe(layer, sd, family=family, prefix=PREFIX, layout=layout)
    np.testing.assert_array_equal(layer.router[...], before)  # nothing written


def test_transposed_down_is_an_error_naming_tensor_shape_and_family():
    # gpt-oss stores down_proj [E, n, d]; a PyTorch-style [E, d, n] (d != n) is rejected.
    config = {**CONFIGS["gpt_oss"], "intermediate_size": N}
    family, num_experts = "gpt_oss", 8
    layer = pm.nn.MoE.from_hf_config(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    sd = {
        PREFIX + "router.weight": rng.standard_normal((num_experts, D)),
        PREFIX + "router.bias": rng.standard_normal(num_experts),
        PREFIX + "experts.gate_up_proj": rng.standard_normal((num_experts, D, 2 * N)),
        PREFIX + "experts.gate_up_proj_bias": rng.standard_normal((num_experts, 2 * N)),
        PREFIX + "experts.down_proj": rng.standard_normal((num_experts, D, N)),  # torch layout: wrong
        PREFIX + "experts.down_proj_bias": rng.standard_normal((num_experts, D)),
    }
    _expect_load_error(family, sd, r"gpt_oss: tensor 'model.layers.1.mlp.experts.down_proj' must have "
                       r"shape \(8, 6, 16\) \(\[E, n, d\], inputs first; not transposed\), got \(8, 16, 6\)",
                       layer=layer)
    # and the reverse: a Mixtral v5 fused down must be [E, d, n], not gpt-oss's [E, n, d]
    sd = random_state_dict("mixtral", "fused")
    sd[PREFIX + "experts.down_proj"] = np.swapaxes(sd[PREFIX + "experts.down_proj"], 1, 2)
    _expect_load_error("mixtral", sd, r"mixtral: tensor '.*experts.down_proj' must have shape \(8, 16, 6\)")


def test_square_gpt_oss_down_is_never_transposed():
    """d == n (as gpt-oss's 2880): shapes cannot tell [E, n, d] from [E, d, n]; the family can.

    Loading the right tensor matches the reference (the main test); loading its transpose
    is accepted by shape but computes something else, which is why the layout comes from
    the family and the loader never transposes gpt-oss's down_proj.
    """
    sd = random_state_dict("gpt_oss", "fused")
    x, _ = inputs("gpt_oss")
    layer = load_layer("gpt_oss", "fused", sd)
    np.testing.assert_array_equal(layer.w_down[...], sd[PREFIX + "experts.down_proj"])
    ref = reference_block(np, "gpt_oss", {k: v.astype(np.float64) for k, v in strip(sd).items()},
                          x.reshape(-1, D).astype(np.float64))
    flipped = dict(sd, **{PREFIX + "experts.down_proj": np.swapaxes(sd[PREFIX + "experts.down_proj"], 1, 2)})
    y_flipped, _ = load_layer("gpt_oss", "fused", flipped)(jnp.asarray(x))
    assert np.max(np.abs(np.asarray(y_flipped).reshape(-1, D) - ref)) > 0.1


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "qwen2_moe"])
def test_per_expert_and_fused_shape_errors(family):
    names = FAMILY_NAMES[family]
    # per-expert down given as [n, d] instead of [d, n]
    sd = random_state_dict(family, "per_expert")
    key = PREFIX + names.per_expert[2].format(e=3)
    sd[key] = sd[key].T
    _expect_load_error(family, sd, rf"{family}: tensor '{key}' must have shape \({D}, {N}\)")
    # fused gate_up given in our [E, d, 2n] layout instead of [E, 2n, d]
    sd = random_state_dict(family, "fused")
    key = PREFIX + "experts.gate_up_proj"
    sd[key] = np.swapaxes(sd[key], 1, 2)
    _expect_load_error(family, sd, rf"{family}: tensor '{key}' must have shape .*gate rows first")
    # router given in our [d, E] layout
    sd = random_state_dict(family, "fused")
    key = PREFIX + names.router
    sd[key] = sd[key].T
    _expect_load_error(family, sd, rf"{family}: tensor '{key}' must have shape")


def test_missing_unused_and_ambiguous_names():
    sd = random_state_dict("qwen2_moe", "per_expert")
    del sd[PREFIX + "shared_expert_gate.weight"]
    _expect_load_error("qwen2_moe", sd, "qwen2_moe: state_dict has no tensor 'model.layers.1.mlp.shared_expert_gate.weight'")
    # MXFP4 tensors (gpt-oss's quantized checkpoints) are not silently ignored
    sd = random_state_dict("gpt_oss", "fused")
    sd[PREFIX + "experts.gate_up_proj_blocks"] = np.zeros((8, 32, 1, 16), np.uint8)
    _expect_load_error("gpt_oss", sd, "does not use: \\['model.layers.1.mlp.experts.gate_up_proj_blocks'\\]")
    # both layouts present: ask, do not guess
    sd = {**random_state_dict("olmoe", "per_expert"), **random_state_dict("olmoe", "fused")}
    _expect_load_error("olmoe", sd, "cannot tell the expert layout")
    _expect_load_error("olmoe", random_state_dict("olmoe", "fused"), "no tensor .*experts.0.gate_proj.weight",
                       layout="per_expert")
    _expect_load_error("gpt_oss", random_state_dict("gpt_oss", "fused"), "gpt_oss has no per-expert layout",
                       layout="per_expert")
    with pytest.raises(ValueError, match="neither"):  # a wrong prefix
        convert.load_hf_moe(pm.nn.MoE.from_hf_config(CONFIGS["qwen3_moe"], rngs=nnx.Rngs(0)),
                            random_state_dict("qwen3_moe", "fused"), family="qwen3_moe", prefix="model.layers.2.mlp.")


def test_layer_must_have_the_family_structure():
    plain = pm.nn.MoE(D, D, 8, 2, rngs=nnx.Rngs(0))
    _expect_load_error("gpt_oss", random_state_dict("gpt_oss", "fused"), "the layer lacks 'router_bias'", layer=plain)
    silu_gpt = pm.nn.MoE(D, D, 8, 2, rngs=nnx.Rngs(0), router_bias=True, expert_bias=True)
    _expect_load_error("gpt_oss", random_state_dict("gpt_oss", "fused"), "'clamped' SwiGLU", layer=silu_gpt)
    shared = pm.nn.MoE(D, N, 8, 2, rngs=nnx.Rngs(0), num_shared_experts=1)
    _expect_load_error("qwen3_moe", random_state_dict("qwen3_moe", "fused"), "the layer has 'shared_gate_up'",
                       layer=shared)
    with pytest.raises(ValueError, match="family must be one of"):
        convert.load_hf_moe(plain, {}, family="qwen3")


# --------------------------------------------------------- options below the module

def test_grouped_topk_keeps_to_the_chosen_groups():
    """Experts outside each token's `topk_groups` best groups are never chosen, even when
    every biased score is negative (where a 0-fill would let them in)."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    bias = jnp.full((16,), -2.0)  # sigmoid + bias < 0 everywhere
    selected, weights = pm.routing.topk_assignment(
        logits, 4, score="sigmoid", bias=bias, num_groups=4, topk_groups=2, renormalize=True
    )
    biased = np.asarray(jax.nn.sigmoid(logits) + bias).reshape(64, 4, 4)
    group_score = np.sort(biased, axis=-1)[..., -2:].sum(-1)  # [T, G]
    best = np.argsort(-group_score, axis=-1)[:, :2]
    allowed = np.zeros((64, 4), bool)
    np.put_along_axis(allowed, best, True, axis=1)
    chosen = np.asarray(selected).reshape(64, 4, 4)
    assert np.all(chosen.sum(-1)[~allowed] == 0) and np.all(np.asarray(selected).sum(-1) == 4)
    # inside the allowed groups, the 4 best biased scores
    masked = np.where(np.repeat(allowed, 4, axis=1), biased.reshape(64, 16), -np.inf)
    expect = np.zeros((64, 16), bool)
    np.put_along_axis(expect, np.argsort(-masked, axis=-1)[:, :4], True, axis=1)
    np.testing.assert_array_equal(np.asarray(selected), expect)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_groups=4), "num_groups and topk_groups go together"),
    (dict(num_groups=3, topk_groups=1), "must divide the E=16 experts"),
    (dict(num_groups=16, topk_groups=1), "groups of at least 2"),
    (dict(num_groups=4, topk_groups=1), "k=5 experts cannot be chosen from topk_groups=1 groups of 4"),
])
def test_grouped_topk_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pm.routing.topk_plan(jnp.zeros((4, 16)), 5, **kwargs)


def test_module_option_errors():
    with pytest.raises(ValueError, match="shared_expert_gate=True needs a shared expert"):
        pm.nn.MoE(D, N, 8, 2, rngs=nnx.Rngs(0), shared_expert_gate=True)
    with pytest.raises(ValueError, match="grouped top-K\\) need routing='topk'"):
        pm.nn.MoE(D, N, 8, 2, rngs=nnx.Rngs(0), routing="token_rounding", num_groups=4, topk_groups=2)
    with pytest.raises(ValueError, match="routed_scaling_factor must be a finite number > 0"):
        pm.nn.MoE(D, N, 8, 2, rngs=nnx.Rngs(0), routed_scaling_factor=0.0)
    with pytest.raises(TypeError, match="activation must be a pallas_moe.ops.activation.SwiGLU"):
        pm.nn.MoE(D, N, 8, 2, rngs=nnx.Rngs(0), activation="gelu")


@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="gelu"), "activation kind must be one of"),
    (dict(kind="silu", limit=7.0), "SwiGLU\\(kind='silu'\\) takes neither"),
    (dict(kind="clamped", alpha=1.702), "limit of a clamped SwiGLU must be a finite number > 0"),
    (dict(kind="clamped", alpha=-1.0, limit=7.0), "alpha of a clamped SwiGLU"),
])
def test_activation_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SwiGLU(**kwargs)


def _ffn_inputs(seed=0, num_tokens=40, d=16, n=8, num_experts=6):
    k = jax.random.split(jax.random.key(seed), 7)
    x = jax.random.normal(k[0], (num_tokens, d))
    w1 = 2.5 * jax.random.normal(k[1], (num_experts, d, 2 * n)) / np.sqrt(d)  # reaches the clamps
    w2 = jax.random.normal(k[2], (num_experts, n, d)) / np.sqrt(n)
    b1 = jax.random.normal(k[3], (num_experts, 2 * n))
    b2 = jax.random.normal(k[4], (num_experts, d))
    logits = jax.random.normal(k[5], (num_tokens, num_experts))
    cot = jax.random.normal(k[6], (num_tokens, d))
    return x, w1, w2, b1, b2, logits, cot


# CI time: the clamped SwiGLU runs the same biased minimal backward plus its clamp; the plain
# one is a slow extra.
@pytest.mark.parametrize("activation", [pytest.param(SwiGLU(), marks=pytest.mark.slow),
                                        SwiGLU.clamped()])
def test_minimal_backward_with_activation_and_biases_matches_autodiff(activation):
    """`moe_ffn_backward` (the kernels' reference) vs jax.grad through the `xla` backend."""
    from pallas_moe.ops.minimal_backward import moe_ffn_backward

    x, w1, w2, b1, b2, logits, cot = _ffn_inputs()
    plan = pm.routing.token_rounding_plan(logits, 2, tile=4)  # padding rows included

    def loss(x, scores, w1, w2, b1, b2):
        out = pm.moe_ffn(x, plan.with_scores(scores), w1, w2, b_gate_up=b1, b_down=b2,
                         activation=activation, backend="xla")
        return jnp.sum(out * cot)

    ref = jax.grad(loss, argnums=tuple(range(6)))(x, plan.scores, w1, w2, b1, b2)
    h = jnp.einsum("pd,pdf->pf", x[plan.token_ids], w1[jnp.minimum(plan.expert_ids, 5)]) + b1[
        jnp.minimum(plan.expert_ids, 5)]
    got = moe_ffn_backward(x, h, plan, w1, w2, cot, activation=activation, b_down=b2)
    valid = np.asarray(plan.row_is_valid)
    for name, g, r in zip(["dx", "d_scores", "dw1", "dw2", "db1", "db2"], got, ref):
        g, r = np.asarray(g), np.asarray(r)
        if name == "d_scores":
            g, r = g[valid], r[valid]
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 * np.max(np.abs(r)), err_msg=name)
    # without biases the contract is unchanged: four gradients
    assert len(moe_ffn_backward(x, h, plan, w1, w2, cot, activation=activation)) == 4


def test_clamped_activation_gradient_matches_autodiff():
    h = jnp.linspace(-12.0, 12.0, 2 * 97).reshape(1, -1)
    act = SwiGLU.clamped(alpha=1.702, limit=7.0)
    grad_a = jnp.cos(jnp.arange(97.0))[None]
    _, vjp = jax.vjp(act, h)
    np.testing.assert_allclose(act.grad(h, grad_a), vjp(grad_a)[0], rtol=1e-6, atol=1e-6)
    gate, up = np.asarray(h[0, :97]), np.asarray(h[0, 97:])
    g = np.minimum(gate, 7.0)
    expect = (np.clip(up, -7, 7) + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(act(h)[0], expect, rtol=1e-6)


def test_auto_picks_the_kernels_for_expert_biases_and_the_clamped_swiglu(monkeypatch):
    """The kernels implement both options: on a (pretend) Hopper with kernel-friendly inputs
    "auto" takes them exactly as for a plain layer, and passes the options through."""
    from pallas_moe.ops import moe_ffn as moe_ffn_module
    from pallas_moe.ops import mosaic

    x, w1, w2, b1, b2, logits, _ = _ffn_inputs()
    plan = pm.routing.topk_plan(logits, 2)
    with pytest.raises(ValueError, match="b_down must be \\[E, d\\] = \\(6, 16\\)"):
        pm.moe_ffn(x, plan, w1, w2, b_down=b2.T, backend="xla")

    class FakeHopper:
        platform, compute_capability = "gpu", "9.0"

    monkeypatch.setattr(moe_ffn_module.jax, "devices", lambda: [FakeHopper()])
    called = []
    monkeypatch.setattr(mosaic, "moe_ffn_kernels", lambda *a, **k: called.append(k) or a[0])
    monkeypatch.setattr(moe_ffn_module, "moe_ffn_xla", lambda *a, **k: pytest.fail("took xla"))
    bf = lambda a: a.astype(jnp.bfloat16)
    xb, w1b, w2b = bf(jnp.zeros((8, 64))), bf(jnp.zeros((6, 64, 128))), bf(jnp.zeros((6, 64, 64)))
    b1b, b2b = bf(jnp.zeros((6, 128))), bf(jnp.zeros((6, 64)))
    plan = pm.routing.topk_plan(logits[:8], 2)
    pm.moe_ffn(xb, plan, w1b, w2b, b_gate_up=b1b, b_down=b2b, activation=SwiGLU.clamped(),
               backend="auto")
    assert called and called[0]["activation"] == SwiGLU.clamped()
    assert called[0]["b_gate_up"] is b1b and called[0]["b_down"] is b2b
