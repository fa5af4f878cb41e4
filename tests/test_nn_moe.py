"""`pallas_moe.nn.MoE`: math, options, errors, NNX transforms, optax, orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import pallas_moe as pm
from pallas_moe.nn import functional as F

D, N, E, K = 16, 8, 8, 2


def make(**kw):
    kw.setdefault("rngs", nnx.Rngs(0))
    kw.setdefault("backend", "xla")
    return pm.nn.MoE(D, N, E, K, **kw)


@nnx.jit
def apply(layer, x, key=None):
    """layer(x) under nnx.jit: eager op-by-op dispatch is far slower on CPU."""
    return layer(x, key=key)


def tokens(shape=(2, 16), seed=1):
    return jax.random.normal(jax.random.key(seed), (*shape, D))


# ----------------------------------------------------------------------------------- math


@pytest.mark.parametrize("routing", ["topk", "token_rounding"])
def test_matches_routing_and_moe_ffn(routing):
    """y and aux equal the library functions composed by hand."""
    layer = make(routing=routing, tile=4, num_shared_experts=1, score="softmax_topk")
    x = tokens()
    y, aux = apply(layer, x)

    @jax.jit
    def by_hand(x, router, w_gate_up, w_down, shared_gate_up, shared_down):
        xt = x.reshape(-1, D)
        logits = xt @ router
        if routing == "topk":
            plan = pm.routing.topk_plan(logits, K)
        else:
            plan = pm.routing.token_rounding_plan(logits, K, tile=4)
        ref = pm.moe_ffn(xt, plan, w_gate_up, w_down, backend="xla")
        ref = ref + F.swiglu_mlp(xt, shared_gate_up, shared_down)
        tc_counts = pm.routing.topk_plan(logits, K).group_sizes
        return ref, {
            "load_balance_loss": pm.routing.load_balancing_loss(logits, plan, K),
            "z_loss": pm.routing.router_z_loss(logits),
            "tc_counts": tc_counts,
            **pm.routing.routing_stats(plan, tc_counts, 4),
        }

    ref, expected = by_hand(
        x, layer.router[...], layer.w_gate_up[...], layer.w_down[...],
        layer.shared_gate_up[...], layer.shared_down[...],
    )
    np.testing.assert_allclose(y.reshape(-1, D), ref, rtol=1e-5, atol=1e-5)
    assert y.shape == x.shape and y.dtype == jnp.float32
    lb, z, tc_counts = expected.pop("load_balance_loss"), expected.pop("z_loss"), expected.pop("tc_counts")
    np.testing.assert_allclose(aux["load_balance_loss"], lb, rtol=1e-5)
    np.testing.assert_allclose(aux["z_loss"], z, rtol=1e-5)
    np.testing.assert_allclose(aux["loss"], 1e-2 * lb + 1e-3 * z, rtol=1e-5)
    for name, value in expected.items():
        np.testing.assert_allclose(aux[name], value, rtol=1e-6, err_msg=name)
    np.testing.assert_array_equal(aux["tc_counts"], tc_counts)
    assert int(aux["capacity_dropped_rows"]) == 0


def test_shapes_leading_dims_and_single_token():
    layer = make()
    for shape in [(D,), (3, D), (2, 3, 4, D)]:
        x = jnp.ones(shape)
        y, _ = apply(layer, x)
        assert y.shape == shape


def test_dtype_policy_bf16_compute():
    layer = make(dtype=jnp.bfloat16, num_shared_experts=1)
    x = tokens()
    y, aux = apply(layer, x)
    assert y.dtype == jnp.bfloat16
    assert layer.w_gate_up[...].dtype == jnp.float32  # params stay in param_dtype
    assert aux["z_loss"].dtype == jnp.float32 and aux["loss"].dtype == jnp.float32
    # Router logits are fp32 whatever the compute dtype: same routing as the fp32 layer.
    _, aux32 = apply(make(num_shared_experts=1), x.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(aux["counts"], aux32["counts"])
    y32, _ = apply(make(num_shared_experts=1), x)
    np.testing.assert_allclose(y.astype(jnp.float32), y32, rtol=0.1, atol=0.05)


def test_param_dtype_and_promotion():
    layer = make(param_dtype=jnp.bfloat16)
    assert layer.w_down[...].dtype == jnp.bfloat16 and layer.router[...].dtype == jnp.bfloat16
    y, _ = apply(layer, tokens())  # f32 input, bf16 params -> f32 compute
    assert y.dtype == jnp.float32
    y, _ = apply(layer, tokens().astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16


def test_shared_experts_width():
    layer = make(num_shared_experts=2)
    assert layer.shared_gate_up.shape == (D, 4 * N) and layer.shared_down.shape == (2 * N, D)
    layer = make(num_shared_experts=1, d_shared=12)
    assert layer.shared_gate_up.shape == (D, 24)
    assert make().shared_gate_up is None


@pytest.mark.parametrize("score", ["softmax_topk", "topk_softmax", "sigmoid"])
def test_score_orders_and_renormalize(score):
    x = tokens()
    y, _ = apply(make(score=score), x)
    y_r, _ = apply(make(score=score, renormalize=True), x)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(y_r))
    if score != "topk_softmax":  # renormalize changes the weights
        assert not np.allclose(y, y_r)


def test_logical_sharding_annotations():
    specs = nnx.get_partition_spec(nnx.state(make(num_shared_experts=1, selection_bias=True, score="sigmoid")))
    assert specs["router"].get_value() == jax.sharding.PartitionSpec("embed", None)
    assert specs["w_gate_up"].get_value() == jax.sharding.PartitionSpec("expert", "embed", "mlp")
    assert specs["w_down"].get_value() == jax.sharding.PartitionSpec("expert", "mlp", "embed")
    assert specs["shared_gate_up"].get_value() == jax.sharding.PartitionSpec("embed", "mlp")
    assert specs["shared_down"].get_value() == jax.sharding.PartitionSpec("mlp", "embed")
    assert specs["selection_bias"].get_value() == jax.sharding.PartitionSpec(None)


def test_eager_sharding_under_a_mesh_with_rules():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
    rules = (("expert", "expert"), ("embed", None), ("mlp", None))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        layer = make()
    sharding = layer.w_gate_up[...].sharding
    assert isinstance(sharding, jax.sharding.NamedSharding)
    assert sharding.spec == jax.sharding.PartitionSpec("expert", None, None)


# --------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=9), "top_k=9 must be <= num_experts=8"),
        (dict(top_k=0), "top_k must be positive"),
        (dict(num_experts=0), "num_experts must be positive"),
        (dict(d_model=0), "d_model must be positive"),
        (dict(d_expert=-4), "d_expert must be positive"),
        (dict(routing="expert_choice"), "routing must be one of"),
        (dict(score="softmax"), "score must be one of"),
        (dict(routing="token_rounding", tile=0), "tile must be positive"),
        (dict(rounding="ceil"), "rounding must be one of"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(selection_bias=True), "selection_bias=True needs score='sigmoid'"),
        (dict(load_balance_weight=-1.0), "load_balance_weight must be a non-negative number"),
        (dict(num_shared_experts=-1), "num_shared_experts must be a non-negative int"),
        (dict(d_shared=8), "d_shared is set but num_shared_experts=0"),
    ],
)
def test_bad_config_names_the_argument(kwargs, match):
    args = dict(d_model=D, d_expert=N, num_experts=E, top_k=K)
    for name in list(args):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    with pytest.raises(ValueError, match=match):
        pm.nn.MoE(args["d_model"], args["d_expert"], args["num_experts"], args["top_k"], rngs=nnx.Rngs(0), **kwargs)


def test_bad_input():
    layer = make()
    with pytest.raises(ValueError, match=r"x must be \[..., d_model=16\]"):
        layer(jnp.ones((4, 15)))
    with pytest.raises(TypeError, match="x must be a floating array"):
        layer(jnp.ones((4, D), jnp.int32))
    with pytest.raises(ValueError, match="update_bias needs a layer built with selection_bias=True"):
        layer.update_bias({"tc_counts": jnp.ones(E)})


# ----------------------------------------------------------------------- selection bias


def test_selection_bias_is_not_a_param_and_balances():
    layer = make(score="sigmoid", selection_bias=True, bias_update_rate=0.05)
    assert isinstance(layer.selection_bias, pm.nn.SelectionBias)
    assert not isinstance(layer.selection_bias, nnx.Param)
    assert "selection_bias" not in nnx.state(layer, nnx.Param)
    # Skew the router so expert 0 is overloaded; the bias then pushes it down.
    layer.router[0, :] = jnp.array([3.0] + [0.0] * (E - 1))
    x = tokens().at[..., 0].set(2.0)
    _, aux0 = apply(layer, x)

    @nnx.jit
    def balance_step(layer, x):
        _, aux = layer(x)
        layer.update_bias(aux)
        return aux

    for _ in range(30):
        aux = balance_step(layer, x)
    bias = layer.selection_bias[...]
    assert bias[0] < 0 and bias[0] == jnp.min(bias)
    assert float(aux["max_load"]) < float(aux0["max_load"])


def test_selection_bias_moves_selection_not_weights():
    layer = make(score="sigmoid", selection_bias=True)
    x = tokens()
    y0, aux0 = apply(layer, x)
    layer.selection_bias[...] = jnp.zeros(E).at[3].set(10.0)  # everyone picks expert 3
    y1, aux1 = apply(layer, x)
    assert int(aux1["counts"][3]) == x.shape[0] * x.shape[1]
    assert not np.allclose(y0, y1)
    # Weights stay sigmoid(logit): with expert 3 forced in, y matches a plan built with bias.
    xt = x.reshape(-1, D)
    logits = xt @ layer.router[...]
    plan = pm.routing.topk_plan(logits, K, score="sigmoid", bias=layer.selection_bias[...])
    ref = pm.moe_ffn(xt, plan, layer.w_gate_up[...], layer.w_down[...], backend="xla")
    np.testing.assert_allclose(y1.reshape(-1, D), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- transforms and training


def test_jit_and_jax_jit_and_grad():
    layer = make(routing="token_rounding", tile=4, num_shared_experts=1)
    x = tokens()
    y_nnx, aux_nnx = apply(layer, x)
    graphdef, state = nnx.split(layer)
    y_jax, aux_jax = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    np.testing.assert_allclose(y_jax, y_nnx, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(aux_jax["counts"], aux_nnx["counts"])

    def loss(m, x):
        y, aux = m(x)
        return jnp.mean(y**2) + aux["loss"]

    value, grads = nnx.jit(nnx.value_and_grad(loss))(layer, x)
    for name in ("router", "w_gate_up", "w_down", "shared_gate_up", "shared_down"):
        g = grads[name][...]
        assert np.all(np.isfinite(g)) and np.any(g != 0), name
    # The router gets gradient from the routed output *and* from the aux losses.
    def aux_only(m, x):
        return m(x)[1]["loss"]

    assert np.any(nnx.grad(aux_only)(layer, x)["router"][...] != 0)


def test_optax_training_loss_decreases():
    layer = make(score="sigmoid", selection_bias=True, num_shared_experts=1)
    optimizer = nnx.Optimizer(layer, optax.adamw(3e-3), wrt=nnx.Param)
    x = tokens((4, 16))
    target = jnp.tanh(x @ jax.random.normal(jax.random.key(7), (D, D)))

    @nnx.jit
    def step(model, optimizer, x, target):
        def loss_fn(model):
            y, aux = model(x)
            return jnp.mean((y - target) ** 2) + aux["loss"], aux

        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        model.update_bias(aux)
        return loss

    bias_before = layer.selection_bias[...]
    losses = [float(step(layer, optimizer, x, target)) for _ in range(40)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert not np.array_equal(layer.selection_bias[...], bias_before)  # moved by update_bias only
    # The optimizer state has no slot for the bias.
    assert "selection_bias" not in str(jax.tree.map(jnp.shape, nnx.state(optimizer)))


def test_scan_over_stacked_layers():
    num_layers = 2

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return pm.nn.MoE(
            D, N, E, K, routing="token_rounding", tile=4, backend="xla", rngs=rngs,
            score="sigmoid", selection_bias=True, bias_update_rate=0.5,
        )

    stack = create(nnx.Rngs(0))
    assert stack.w_gate_up.shape == (num_layers, E, D, 2 * N)

    def forward(stack, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
        def body(layer, h):
            y, aux = layer(h)
            return h + y, aux

        return body(stack, x)

    x = tokens()
    h, aux = nnx.jit(forward)(stack, x)
    assert aux["loss"].shape == (num_layers,) and aux["counts"].shape == (num_layers, E)

    # The same as running the layers one by one.
    graphdef, state = nnx.split(stack)
    ref = x
    for i in range(num_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        y, aux_i = layer(ref)
        ref = ref + y
        np.testing.assert_allclose(aux["loss"][i], aux_i["loss"], rtol=1e-5)
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-5)

    # update_bias on the stack moves each layer's bias with that layer's counts.
    stack.update_bias(aux)
    for i in range(num_layers):
        expected = pm.routing.update_selection_bias(jnp.zeros(E), aux["tc_counts"][i], 0.5)
        np.testing.assert_allclose(stack.selection_bias[...][i], expected)

    def loss(stack, x):
        h, aux = forward(stack, x)
        return jnp.mean(h**2) + jnp.sum(aux["loss"])

    grads = nnx.jit(nnx.grad(loss))(stack, x)
    assert grads["w_down"][...].shape == (num_layers, E, N, D)
    assert np.all(np.any(grads["w_down"][...] != 0, axis=(1, 2, 3)))


def test_stochastic_rounding_uses_the_routing_stream_and_key():
    layer = make(routing="token_rounding", tile=4, rounding="stochastic", rngs=nnx.Rngs(0, routing=5))
    x = tokens((4, 16))
    counts = {tuple(np.asarray(apply(layer, x)[1]["counts"])) for _ in range(6)}
    assert len(counts) > 1  # the stream advances every call
    key = jax.random.key(3)
    np.testing.assert_array_equal(apply(layer, x, key)[1]["counts"], apply(layer, x, key)[1]["counts"])
    assert all(c % 4 == 0 for c in np.asarray(apply(layer, x, key)[1]["counts"]))


def test_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    layer = make(
        routing="token_rounding", tile=4, rounding="stochastic", score="sigmoid",
        selection_bias=True, num_shared_experts=1, rngs=nnx.Rngs(0, routing=1),
    )
    layer.selection_bias[...] = jnp.linspace(-0.1, 0.1, E)
    apply(layer, tokens())  # advance the routing stream
    state = nnx.state(layer)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "moe", nnx.to_pure_dict(state))
    checkpointer.wait_until_finished()

    fresh = make(
        routing="token_rounding", tile=4, rounding="stochastic", score="sigmoid",
        selection_bias=True, num_shared_experts=1, rngs=nnx.Rngs(42, routing=9),
    )
    abstract = nnx.to_pure_dict(nnx.state(fresh))
    restored = checkpointer.restore(tmp_path / "moe", abstract)
    nnx.replace_by_pure_dict(state_fresh := nnx.state(fresh), restored)
    nnx.update(fresh, state_fresh)

    before = jax.tree.leaves(nnx.to_pure_dict(nnx.state(layer)), is_leaf=lambda a: hasattr(a, "dtype"))
    after = jax.tree.leaves(nnx.to_pure_dict(nnx.state(fresh)), is_leaf=lambda a: hasattr(a, "dtype"))
    assert len(before) == len(after) >= 7
    for a, b in zip(before, after):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    x = tokens()
    np.testing.assert_array_equal(apply(layer, x)[0], apply(fresh, x)[0])  # same params, bias and stream


# ------------------------------------------------------------------------- fp8 inference


def test_quantize_fp8_runs_moe_ffn_fp8_and_dequantize_restores():
    """A quantized layer's routed part is `pm.quant.moe_ffn_fp8` on the layer's own plan and
    e4m3 weights (the shared MLP and aux unchanged); `dequantize_fp8` gives back the earlier
    output bit for bit; the e4m3 copy is not a parameter."""
    layer = make(num_shared_experts=1, score="softmax_topk")
    x = tokens()
    y_before, aux_before = apply(layer, x)
    layer.quantize_fp8()
    assert isinstance(layer.quantized, pm.quant.QuantizedExperts)
    assert "fp8_experts" not in nnx.state(layer, nnx.Param)
    y, aux = apply(layer, x)

    xt = x.reshape(-1, D)
    plan = pm.routing.topk_plan(xt @ layer.router[...], K)
    experts = pm.quant.quantize_experts(layer.w_gate_up[...], layer.w_down[...])
    routed = pm.quant.moe_ffn_fp8(xt.astype(jnp.bfloat16), plan, experts, backend="xla")
    ref = routed.astype(jnp.float32) + F.swiglu_mlp(xt, layer.shared_gate_up[...], layer.shared_down[...])
    np.testing.assert_allclose(y.reshape(-1, D), ref, rtol=1e-5, atol=1e-5)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(aux["counts"], aux_before["counts"])
    # fp8 is an approximation of the layer, not another layer (the fp8 tests' 10% bound).
    rel = np.linalg.norm(y - y_before) / np.linalg.norm(y_before)
    assert 0 < rel < 0.1, rel

    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    y_merged, _ = apply(nnx.merge(graphdef, params, rest), x)
    np.testing.assert_array_equal(y_merged, y)

    layer.dequantize_fp8()
    assert layer.quantized is None
    y_after, _ = apply(layer, x)
    np.testing.assert_array_equal(y_after, y_before)


def test_quantize_fp8_is_inference_only_and_checks_the_layer():
    layer = make()
    layer.quantize_fp8()
    x = tokens()

    def loss(layer, x):
        return jnp.sum(layer(x)[0])

    with pytest.raises(TypeError):
        nnx.grad(loss)(layer, x)
    with pytest.raises(ValueError, match="activation"):
        make(activation=pm.ops.SwiGLU.clamped(alpha=1.702, limit=7.0)).quantize_fp8()
    with pytest.raises(ValueError, match="expert_bias"):
        make(expert_bias=True).quantize_fp8()
    with pytest.raises(ValueError, match="smooth_up"):
        make().quantize_fp8(smooth_up=jnp.ones((E, D + 1), jnp.float32))


# --------------------------------------------------------------------------- kernel_config


def test_kernel_config_reaches_moe_ffn_and_is_checked(monkeypatch):
    """`kernel_config` is `moe_ffn`'s `config` (what `moe_ffn` does with it is the kernels'
    tests' business: here a spy checks it arrives, then runs the reference); bad
    combinations are refused at construction."""
    from pallas_moe.kernels import KernelConfig
    from pallas_moe.nn import moe as moe_module

    d, n = 128, 64
    cfg = KernelConfig.for_shape(d, n)
    seen = []

    def spy(*args, config=None, backend=None, **kwargs):
        seen.append((config, backend))
        return pm.moe_ffn(*args, backend="xla", **kwargs)

    monkeypatch.setattr(moe_module, "moe_ffn", spy)
    layer = pm.nn.MoE(d, n, 4, 2, rngs=nnx.Rngs(0), backend="interpret", kernel_config=cfg)
    x = jax.random.normal(jax.random.key(2), (8, d))
    y, _ = layer(x)
    assert seen == [(cfg, "interpret")] and y.shape == x.shape

    with pytest.raises(TypeError, match="kernel_config must be a pallas_moe.kernels.KernelConfig"):
        make(kernel_config=cfg.forward)
    with pytest.raises(ValueError, match="backend='xla' runs no kernels"):
        make(backend="xla", kernel_config=cfg)
