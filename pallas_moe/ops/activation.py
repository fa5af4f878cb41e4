"""The expert activation of `moe_ffn`: a small frozen spec shared by every backend.

`H = [gate, up]` is the `[..., 2n]` up-projection output (gate = `H[..., :n]`, up =
`H[..., n:]`, expert biases included). Two kinds:

* `SwiGLU()` (kind "silu"): `A = silu(gate) * up`. Qwen, Mixtral, OLMoE, DeepSeek.
* `SwiGLU.clamped(alpha=1.702, limit=7.0)` (kind "clamped", gpt-oss):
  `g = min(gate, limit)`, `u = clip(up, -limit, limit)`, `A = (u + 1) * g * sigmoid(alpha * g)`.

The spec is hashable (a valid `jit` static argument) and carries its own forward and
gradient on the fp32 halves (`apply`, `grad_halves`), so the `xla` backend, the jnp minimal
backward and the kernel epilogues (`kernels._common.swiglu_epilogue`, `kernels.dh`)
compute one formula: elementwise selects, products and one sigmoid, all of which lower
in Mosaic GPU kernels. Clamps pass the gradient where the input is inside the closed
interval (`gate <= limit`, `-limit <= up <= limit`), as PyTorch's `clamp` does.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

ACTIVATION_KINDS = ("silu", "clamped")


@dataclasses.dataclass(frozen=True)
class SwiGLU:
    """Gated expert activation over `h = [gate, up]` of shape [..., 2n].

    Attributes:
      kind: "silu" (`silu(gate) * up`) or "clamped" (gpt-oss; see the module docstring).
      alpha: sigmoid slope of "clamped" (gpt-oss: 1.702); None for "silu".
      limit: clamp bound of "clamped" (gpt-oss: 7.0); None for "silu".
    """

    kind: str = "silu"
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self):
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"activation kind must be one of {list(ACTIVATION_KINDS)}, got {self.kind!r}.")
        if self.kind == "silu":
            if self.alpha is not None or self.limit is not None:
                raise ValueError(
                    "alpha and limit belong to kind='clamped'; SwiGLU(kind='silu') takes neither, "
                    f"got alpha={self.alpha!r}, limit={self.limit!r}."
                )
            return
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{name} of a clamped SwiGLU must be a finite number > 0, got {value!r}.")
            object.__setattr__(self, name, float(value))

    @classmethod
    def clamped(cls, alpha: float = 1.702, limit: float = 7.0) -> "SwiGLU":
        """gpt-oss's clamped SwiGLU: `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate, limit)`."""
        return cls(kind="clamped", alpha=alpha, limit=limit)

    def __call__(self, h: jax.Array) -> jax.Array:
        """A = act(h) in fp32: h [..., 2n] (any float dtype) -> f32[..., n]."""
        return self.apply(*_split(h))

    def apply(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """A from the fp32 halves `gate`, `up` (same shape) -> fp32, same shape."""
        if self.kind == "silu":
            return gate * jax.nn.sigmoid(gate) * up  # silu(gate) * up
        g, u, _, _ = self._clamp(gate, up)
        return (u + 1.0) * g * jax.nn.sigmoid(self.alpha * g)

    def grad(self, h: jax.Array, grad_a: jax.Array) -> jax.Array:
        """dL/dh in fp32 [..., 2n] (gate part first) given h [..., 2n] and grad_a = dL/dA [..., n]."""
        gate, up = _split(h)
        return jnp.concatenate(self.grad_halves(gate, up, grad_a.astype(jnp.float32)), axis=-1)

    def grad_halves(
        self, gate: jax.Array, up: jax.Array, grad_a: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(dL/dgate, dL/dup) in fp32 from the fp32 halves and grad_a = dL/dA (same shapes).

        Clamped: zero where the clamp is active (`gate > limit`, `|up| > limit`), the
        value's gradient on the closed interval, as PyTorch's clamp.
        """
        if self.kind == "silu":
            sig = jax.nn.sigmoid(gate)
            d_gate = grad_a * up * sig * (1 + gate * (1 - sig))
            d_up = grad_a * gate * sig
            return d_gate, d_up
        g, u, gate_passes, up_passes = self._clamp(gate, up)
        sig = jax.nn.sigmoid(self.alpha * g)
        d_g = grad_a * (u + 1.0) * sig * (1 + self.alpha * g * (1 - sig))
        d_gate = jnp.where(gate_passes, d_g, 0.0)
        d_up = jnp.where(up_passes, grad_a * g * sig, 0.0)
        return d_gate, d_up

    def _clamp(self, gate, up):
        limit = self.limit
        gate_passes = gate <= limit
        up_passes = (up >= -limit) & (up <= limit)
        # where() rather than minimum/clip: their gradient splits ties, PyTorch's clamp does not.
        g = jnp.where(gate_passes, gate, limit)
        u = jnp.where(up_passes, up, jnp.where(up > limit, limit, -limit))
        return g, u, gate_passes, up_passes


def _split(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = h.shape[-1] // 2
    h = h.astype(jnp.float32)
    return h[..., :n], h[..., n:]


def check_activation(activation) -> SwiGLU:
    """Returns `activation` if it is a `SwiGLU` spec, else raises a TypeError naming it."""
    if not isinstance(activation, SwiGLU):
        raise TypeError(
            "activation must be a pallas_moe.ops.activation.SwiGLU (e.g. SwiGLU() or "
            f"SwiGLU.clamped(alpha=1.702, limit=7.0)), got {type(activation).__name__}."
        )
    return activation
