"""Converters between the usual MoE checkpoint layouts and ours.

Ours (`docs/contract.md`): `w_gate_up [E, d, 2n]` with gate = `[..., :n]`, up = `[..., n:]`,
`w_down [E, n, d]`, router `[d, E]`; `y = x @ W` (inputs on the left).

PyTorch `nn.Linear` stores `weight [out, in]` and computes `x @ weight.T`, so per expert:
gate_proj / w1 `[n, d]`, up_proj / w3 `[n, d]`, down_proj / w2 `[d, n]`, router `[E, d]`.
Fused PyTorch experts stack them: gate_up `[E, 2n, d]` (gate rows first, or interleaved
gate/up rows with `interleaved=True`), down `[E, d, n]`.

Every function works on numpy arrays (host-side conversion of large checkpoints, result in
numpy) and on jax arrays (result in jax), and every `from_*` has a `to_*` inverse.

`load_hf_moe(layer, state_dict, family=...)` loads a whole Hugging Face MoE block by the
family's own parameter names and layouts (`pallas_moe.nn.families`), checking every shape.
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
    values = {"w_gate_up": w_gate_up, "w_down": w_down}
    if router is not None:
        values["router"] = router
    _write_params(layer, values)


def _write_params(layer, values: dict) -> None:
    """Checks every value's shape against the layer's variable, then writes them all."""
    for name, value in values.items():
        variable = getattr(layer, name)
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(f"{name} must have shape {tuple(variable.shape)}, got {tuple(value.shape)}.")
    for name, value in values.items():
        variable = getattr(layer, name)
        variable[...] = jnp.asarray(value, dtype=variable.dtype)


def load_hf_moe(layer, state_dict, *, family: str, prefix: str = "", layout: str | None = None, strict: bool = True) -> None:
    """Loads one Hugging Face MoE block's weights into a `pallas_moe.nn.MoE`, numpy only.

    The layer must have the family's structure: build it with `MoE.from_hf_config(config)`.
    Layouts come from `family` (see `pallas_moe.nn.families`), never from shapes: every
    tensor must have exactly the shape the family stores, else a ValueError names the
    tensor, the expected shape and the family. (A shape check alone cannot catch a
    transposed square tensor, such as gpt-oss's `down_proj [E, n, d]` at d == n == 2880;
    reading the layout from the family is what keeps it right.)

    Args:
      layer: a `pm.nn.MoE` of matching widths and options.
      state_dict: a mapping from names to numpy arrays (e.g. a safetensors file read with
        `safetensors.numpy.load_file`); jax arrays work too. No torch needed.
      family: "qwen3_moe" | "mixtral" | "olmoe" | "deepseek_v3" | "qwen2_moe" | "gpt_oss".
      prefix: the block's prefix in `state_dict`, e.g. "model.layers.3.mlp." (Mixtral's
        original checkpoints: "model.layers.3.block_sparse_moe.").
      layout: "per_expert" (`experts.{e}.gate_proj.weight`, ...) or "fused"
        (`experts.gate_up_proj`, ...). None picks the one whose names are present (by
        name only; it is an error if both or neither are).
      strict: raise if `state_dict` holds names under `prefix` that the block does not use
        (for example MXFP4-quantized `*_blocks` / `*_scales`: dequantize them first).

    Writes router (and router_bias, selection_bias), w_gate_up, w_down (and b_gate_up,
    b_down), shared_gate_up, shared_down (and shared_gate), cast to the parameters' dtype.
    Nothing is written unless every tensor checks out.
    """
    from pallas_moe.nn.families import FAMILY_NAMES, LAYOUTS, check_family

    names = FAMILY_NAMES[check_family(family)]
    num_experts, d, n = layer.num_experts, layer.d_model, layer.d_expert
    used: set[str] = set()

    def take(name: str, shape: tuple, what: str):
        key = prefix + name
        if key not in state_dict:
            raise ValueError(f"{family}: state_dict has no tensor {key!r} ({what}, shape {shape}).")
        value = state_dict[key]
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{family}: tensor {key!r} must have shape {shape} ({what}), got {tuple(value.shape)}."
            )
        used.add(key)
        return np.asarray(value)

    def present(name: str) -> bool:
        return prefix + name in state_dict

    # The layer must be built for this family (from_hf_config), or loading would drop terms.
    structure = {
        "router_bias": names.router_bias is not None,
        "selection_bias": names.selection_bias is not None,
        "b_gate_up": names.fused_gate_up_bias is not None,
        "shared_gate_up": names.shared is not None,
        "shared_gate": names.shared_gate is not None,
    }
    for attr, wanted in structure.items():
        if (getattr(layer, attr) is not None) != wanted:
            raise ValueError(
                f"{family}: the layer {'lacks' if wanted else 'has'} {attr!r}, which a {family} block "
                f"{'has' if wanted else 'does not have'}; build it with pm.nn.MoE.from_hf_config(config)."
            )

    wanted_activation = "clamped" if names.fused_gate_up_bias else "silu"
    if layer.activation.kind != wanted_activation:
        raise ValueError(
            f"{family}: the layer's activation is {layer.activation}, but {family} experts use the "
            f"{wanted_activation!r} SwiGLU; build it with pm.nn.MoE.from_hf_config(config)."
        )

    if layout is None:
        fused = present(names.fused_gate_up)
        per_expert = names.per_expert is not None and present(names.per_expert[0].format(e=0))
        if fused == per_expert:
            expected = [names.fused_gate_up] + ([names.per_expert[0].format(e=0)] if names.per_expert else [])
            raise ValueError(
                f"{family}: cannot tell the expert layout from the names under prefix {prefix!r}: "
                f"{'both' if fused else 'neither'} of {[prefix + e for e in expected]} "
                f"{'are' if fused else 'is'} present; pass layout= or the right prefix."
            )
        layout = "fused" if fused else "per_expert"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)} or None, got {layout!r}.")
    if layout == "per_expert" and names.per_expert is None:
        raise ValueError(f"{family} has no per-expert layout; its experts are fused (layout='fused').")

    values = {"router": router_from_torch(take(names.router, (num_experts, d), "router, [E, d]"))}
    if names.router_bias:
        values["router_bias"] = take(names.router_bias, (num_experts,), "router bias, [E]")
    if names.selection_bias:
        values["selection_bias"] = take(names.selection_bias, (num_experts,), "score-correction bias, [E]")

    if layout == "per_expert":
        gate_name, up_name, down_name = names.per_expert
        gates, ups, downs = [], [], []
        for e in range(num_experts):
            gates.append(take(gate_name.format(e=e), (n, d), "expert gate projection, [n, d]"))
            ups.append(take(up_name.format(e=e), (n, d), "expert up projection, [n, d]"))
            downs.append(take(down_name.format(e=e), (d, n), "expert down projection, [d, n]"))
        values["w_gate_up"], values["w_down"] = from_per_expert(gates, ups, downs, layout="torch")
    elif names.fused_inputs_first:
        # gpt-oss: [E, d, 2n] with gate/up interleaved along the last axis, down already [E, n, d].
        gate_up = take(names.fused_gate_up, (num_experts, d, 2 * n), "[E, d, 2n], gate/up interleaved")
        values["w_gate_up"] = gate_up_from_torch(np.swapaxes(gate_up, 1, 2), interleaved=True)
        values["w_down"] = take(names.fused_down, (num_experts, n, d), "[E, n, d], inputs first; not transposed")
    else:
        values["w_gate_up"] = gate_up_from_torch(
            take(names.fused_gate_up, (num_experts, 2 * n, d), "[E, 2n, d], gate rows first")
        )
        values["w_down"] = down_from_torch(take(names.fused_down, (num_experts, d, n), "[E, d, n]"))
    if names.fused_gate_up_bias:
        bias = take(names.fused_gate_up_bias, (num_experts, 2 * n), "[E, 2n], gate/up interleaved")
        values["b_gate_up"] = gate_up_from_torch(bias[:, :, None], interleaved=True)[:, 0, :]
        values["b_down"] = take(names.fused_down_bias, (num_experts, d), "[E, d]")

    if names.shared:
        m = layer.shared_down.shape[0]
        gate_name, up_name, down_name = names.shared
        shared_gate_up, shared_down = from_torch_experts(
            take(gate_name, (m, d), "shared expert gate projection, [m, d]")[None],
            take(up_name, (m, d), "shared expert up projection, [m, d]")[None],
            take(down_name, (d, m), "shared expert down projection, [d, m]")[None],
        )
        values["shared_gate_up"], values["shared_down"] = shared_gate_up[0], shared_down[0]
    if names.shared_gate:
        values["shared_gate"] = router_from_torch(take(names.shared_gate, (1, d), "shared expert gate, [1, d]"))

    if strict:
        unused = sorted(key for key in state_dict if key.startswith(prefix) and key not in used)
        if unused:
            raise ValueError(
                f"{family}: state_dict holds names under prefix {prefix!r} that a {family} MoE block "
                f"({layout} layout) does not use: {unused[:8]}{' ...' if len(unused) > 8 else ''}. "
                "Pass the block's own prefix, dequantize quantized tensors first, or strict=False."
            )
    _write_params(layer, values)
