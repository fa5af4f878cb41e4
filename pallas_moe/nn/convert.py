"""Converters between the usual MoE checkpoint layouts and ours.

Ours (DESIGN.md section 3): `w_gate_up [E, d, 2n]` with gate = `[..., :n]`, up = `[..., n:]`,
`w_down [E, n, d]`, router `[d, E]`; `y = x @ W` (inputs on the left).

PyTorch `nn.Linear` stores `weight [out, in]` and computes `x @ weight.T`, so per expert:
gate_proj / w1 `[n, d]`, up_proj / w3 `[n, d]`, down_proj / w2 `[d, n]`, router `[E, d]`.
Fused PyTorch experts stack them: gate_up `[E, 2n, d]` (gate rows first, or interleaved
gate/up rows with `interleaved=True`), down `[E, d, n]`.

Every function works on numpy arrays (host-side conversion of large checkpoints, result in
numpy) and on jax arrays (result in jax), and every `from_*` has a `to_*` inverse.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np


def _xp(*arrays):
    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def _check_ndim(name, a, ndim):
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(a.shape)}.")


def gate_up_from_torch(w: "np.ndarray | jnp.ndarray", *, interleaved: bool = False):
    """[E, 2n, d] fused PyTorch gate/up weight -> our [E, d, 2n].

    `interleaved=False`: rows `[:n]` are gate and `[n:]` up. `interleaved=True`: rows
    alternate gate, up, gate, up (row 2i is gate unit i, row 2i+1 up unit i).
    """
    _check_ndim("w", w, 3)
    xp = _xp(w)
    num_experts, two_n, d = w.shape
    if two_n % 2:
        raise ValueError(f"w must be [E, 2n, d] with an even 2n, got shape {tuple(w.shape)}.")
    if interleaved:
        n = two_n // 2
        w = w.reshape(num_experts, n, 2, d).transpose(0, 2, 1, 3).reshape(num_experts, two_n, d)
    return xp.swapaxes(w, 1, 2)


def gate_up_to_torch(w_gate_up, *, interleaved: bool = False):
    """Our [E, d, 2n] -> fused PyTorch [E, 2n, d] (inverse of `gate_up_from_torch`)."""
    _check_ndim("w_gate_up", w_gate_up, 3)
    xp = _xp(w_gate_up)
    num_experts, d, two_n = w_gate_up.shape
    if two_n % 2:
        raise ValueError(f"w_gate_up must be [E, d, 2n] with an even 2n, got {tuple(w_gate_up.shape)}.")
    w = xp.swapaxes(w_gate_up, 1, 2)  # [E, 2n, d]
    if interleaved:
        n = two_n // 2
        w = w.reshape(num_experts, 2, n, d).transpose(0, 2, 1, 3).reshape(num_experts, two_n, d)
    return w


def down_from_torch(w):
    """[E, d, n] PyTorch down weights -> our [E, n, d]."""
    _check_ndim("w", w, 3)
    return _xp(w).swapaxes(w, 1, 2)


def down_to_torch(w_down):
    """Our [E, n, d] -> PyTorch [E, d, n]."""
    _check_ndim("w_down", w_down, 3)
    return _xp(w_down).swapaxes(w_down, 1, 2)


def router_from_torch(w):
    """PyTorch router (gate) Linear weight [E, d] -> our router [d, E]."""
    _check_ndim("w", w, 2)
    return _xp(w).swapaxes(w, 0, 1)


def router_to_torch(router):
    """Our router [d, E] -> PyTorch [E, d]."""
    _check_ndim("router", router, 2)
    return _xp(router).swapaxes(router, 0, 1)


def from_torch_experts(gate, up, down):
    """Stacked PyTorch gate [E, n, d], up [E, n, d], down [E, d, n] -> (w_gate_up [E, d, 2n], w_down [E, n, d])."""
    for name, a in (("gate", gate), ("up", up), ("down", down)):
        _check_ndim(name, a, 3)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape [E, n, d], got {gate.shape} and {up.shape}.")
    num_experts, n, d = gate.shape
    if down.shape != (num_experts, d, n):
        raise ValueError(f"down must be [E, d, n] = {(num_experts, d, n)}, got {tuple(down.shape)}.")
    xp = _xp(gate, up, down)
    w_gate_up = xp.concatenate([xp.swapaxes(gate, 1, 2), xp.swapaxes(up, 1, 2)], axis=2)  # [E, d, 2n]
    return w_gate_up, xp.swapaxes(down, 1, 2)


def to_torch_experts(w_gate_up, w_down):
    """(w_gate_up [E, d, 2n], w_down [E, n, d]) -> PyTorch (gate [E, n, d], up [E, n, d], down [E, d, n])."""
    _check_ndim("w_gate_up", w_gate_up, 3)
    _check_ndim("w_down", w_down, 3)
    num_experts, d, two_n = w_gate_up.shape
    n = two_n // 2
    if two_n % 2 or w_down.shape != (num_experts, n, d):
        raise ValueError(
            f"expected w_gate_up [E, d, 2n] and w_down [E, n, d]; got {tuple(w_gate_up.shape)} "
            f"and {tuple(w_down.shape)}."
        )
    xp = _xp(w_gate_up, w_down)
    gate = xp.swapaxes(w_gate_up[..., :n], 1, 2)  # [E, n, d]
    up = xp.swapaxes(w_gate_up[..., n:], 1, 2)  # [E, n, d]
    return gate, up, xp.swapaxes(w_down, 1, 2)


def from_per_expert(
    gates: Sequence, ups: Sequence, downs: Sequence, *, layout: str = "torch"
):
    """Separate per-expert weights -> (w_gate_up [E, d, 2n], w_down [E, n, d]).

    Args:
      gates, ups, downs: one array per expert (HF `experts.{e}.gate_proj/up_proj/down_proj`,
        Mixtral `w1/w3/w2`).
      layout: "torch" (gate/up [n, d], down [d, n]: Linear [out, in]) or "jax"
        (gate/up [d, n], down [n, d]: inputs on the left).
    """
    if layout not in ("torch", "jax"):
        raise ValueError(f"layout must be one of ['jax', 'torch'], got {layout!r}.")
    if not (len(gates) == len(ups) == len(downs)) or not gates:
        raise ValueError(
            f"gates, ups and downs must list the same number (>= 1) of experts, got "
            f"{len(gates)}, {len(ups)} and {len(downs)}."
        )
    xp = _xp(*gates, *ups, *downs)
    gate, up, down = (xp.stack(list(a)) for a in (gates, ups, downs))
    if layout == "jax":  # to the torch layout, then one code path
        gate, up, down = (xp.swapaxes(a, 1, 2) for a in (gate, up, down))
    return from_torch_experts(gate, up, down)


def to_per_expert(w_gate_up, w_down, *, layout: str = "torch"):
    """(w_gate_up, w_down) -> (gates, ups, downs), lists of per-expert arrays (see `from_per_expert`)."""
    if layout not in ("torch", "jax"):
        raise ValueError(f"layout must be one of ['jax', 'torch'], got {layout!r}.")
    gate, up, down = to_torch_experts(w_gate_up, w_down)
    if layout == "jax":
        xp = _xp(w_gate_up, w_down)
        gate, up, down = (xp.swapaxes(a, 1, 2) for a in (gate, up, down))
    return list(gate), list(up), list(down)


def load_experts(layer, w_gate_up, w_down, router=None) -> None:
    """Writes converted weights into a `pallas_moe.nn.MoE` (cast to its `param_dtype`).

    Args:
      layer: the module.
      w_gate_up: [E, d, 2n]; w_down: [E, n, d]; router: optional [d, E].
    """
    pairs = [("w_gate_up", w_gate_up), ("w_down", w_down)]
    if router is not None:
        pairs.append(("router", router))
    for name, value in pairs:
        variable = getattr(layer, name)
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"{name} must have shape {tuple(variable.shape)}, got {tuple(value.shape)}.")
    for name, value in pairs:
        variable = getattr(layer, name)
        variable[...] = jnp.asarray(value, dtype=variable.dtype)
