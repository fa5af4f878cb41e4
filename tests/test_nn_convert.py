"""Checkpoint-layout converters: round trips, and outputs equal to a PyTorch-layout reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_moe as pm
from pallas_moe.nn import convert

E, D, N = 4, 6, 5


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def torch_experts(seed=0):
    """PyTorch nn.Linear layout: gate/up [E, n, d] ([out, in]), down [E, d, n]."""
    return rand(E, N, D, seed=seed), rand(E, N, D, seed=seed + 1), rand(E, D, N, seed=seed + 2)


def test_torch_fused_round_trip_and_layout():
    gate, up, down = torch_experts()
    fused = np.concatenate([gate, up], axis=1)  # [E, 2n, d]
    w_gate_up = convert.gate_up_from_torch(fused)
    assert isinstance(w_gate_up, np.ndarray) and w_gate_up.shape == (E, D, 2 * N)
    np.testing.assert_array_equal(w_gate_up[..., :N], gate.transpose(0, 2, 1))  # gate first
    np.testing.assert_array_equal(w_gate_up[..., N:], up.transpose(0, 2, 1))
    np.testing.assert_array_equal(convert.gate_up_to_torch(w_gate_up), fused)
    w_down = convert.down_from_torch(down)
    assert w_down.shape == (E, N, D)
    np.testing.assert_array_equal(convert.down_to_torch(w_down), down)


def test_interleaved_gate_up():
    gate, up, _ = torch_experts()
    interleaved = np.stack([gate, up], axis=2).reshape(E, 2 * N, D)  # rows g0, u0, g1, u1, ...
    w_gate_up = convert.gate_up_from_torch(interleaved, interleaved=True)
    np.testing.assert_array_equal(w_gate_up, convert.gate_up_from_torch(np.concatenate([gate, up], 1)))
    np.testing.assert_array_equal(convert.gate_up_to_torch(w_gate_up, interleaved=True), interleaved)


@pytest.mark.parametrize("layout", ["torch", "jax"])
def test_per_expert_round_trip(layout):
    gate, up, down = torch_experts()
    if layout == "jax":
        gates, ups, downs = ([a.T for a in arr] for arr in (gate, up, down))
    else:
        gates, ups, downs = list(gate), list(up), list(down)
    w_gate_up, w_down = convert.from_per_expert(gates, ups, downs, layout=layout)
    ref_gate_up, ref_down = convert.from_torch_experts(gate, up, down)
    np.testing.assert_array_equal(w_gate_up, ref_gate_up)
    np.testing.assert_array_equal(w_down, ref_down)
    back = convert.to_per_expert(w_gate_up, w_down, layout=layout)
    for original, recovered in zip((gates, ups, downs), back):
        assert len(recovered) == E
        for a, b in zip(original, recovered):
            np.testing.assert_array_equal(a, b)


def test_stacked_round_trip_jax_arrays():
    gate, up, down = (jnp.asarray(a) for a in torch_experts())
    w_gate_up, w_down = convert.from_torch_experts(gate, up, down)
    assert isinstance(w_gate_up, jax.Array)
    for a, b in zip(convert.to_torch_experts(w_gate_up, w_down), (gate, up, down)):
        np.testing.assert_array_equal(a, b)
    router = rand(E, D)
    np.testing.assert_array_equal(convert.router_to_torch(convert.router_from_torch(router)), router)


def test_converted_layer_matches_torch_semantics():
    """A layer loaded from PyTorch-layout weights computes the PyTorch-style MoE."""
    gate, up, down = torch_experts(seed=3)
    router_t = rand(E, D, seed=9)  # nn.Linear(d, E).weight
    layer = pm.nn.MoE(D, N, E, 2, rngs=nnx.Rngs(0), backend="xla")
    convert.load_experts(layer, *convert.from_torch_experts(gate, up, down), convert.router_from_torch(router_t))
    x = rand(7, D, seed=4)
    y, _ = nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x))

    # Reference in the PyTorch convention: F.linear(x, W) = x @ W.T, softmax then top-2.
    silu = lambda v: v / (1 + np.exp(-v))
    logits = x @ router_t.T  # [T, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e in np.argsort(-probs[t])[:2]:
            hidden = silu(x[t] @ gate[e].T) * (x[t] @ up[e].T)  # [n]
            ref[t] += probs[t, e] * (hidden @ down[e].T)  # [d]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_converter_errors():
    gate, up, down = torch_experts()
    with pytest.raises(ValueError, match="down must be"):
        convert.from_torch_experts(gate, up, down.transpose(0, 2, 1))
    with pytest.raises(ValueError, match="even 2n"):
        convert.gate_up_from_torch(rand(E, 5, D))
    with pytest.raises(ValueError, match="layout must be one of"):
        convert.from_per_expert(list(gate), list(up), list(down), layout="pt")
    with pytest.raises(ValueError, match="same number"):
        convert.from_per_expert(list(gate), list(up)[:2], list(down))
    layer = pm.nn.MoE(D, N, E, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="w_gate_up must have shape"):
        convert.load_experts(layer, rand(E, D, N), rand(E, N, D))
