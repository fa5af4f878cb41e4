"""`pm.moe_ffn`: the differentiable MoE feed-forward over a dispatch plan."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.numerics import Numerics, check_activation_dtype, check_numerics
from pallas_moe.ops.xla import moe_ffn_xla
from pallas_moe.routing.plan import DispatchPlan

Backend = Literal["auto", "mosaic", "interpret", "xla"]
BACKENDS = ("auto", "mosaic", "interpret", "xla")


def check_moe_inputs(
    x: jax.Array, plan: DispatchPlan, w_gate_up: jax.Array, w_down: jax.Array
) -> None:
    """Raises a clear error when shapes or dtypes of `moe_ffn` inputs disagree."""
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a pallas_moe.routing.DispatchPlan, got {type(plan).__name__}.")
    _checks.check_floating("x", x, ndim=2)
    _checks.check_floating("w_gate_up", w_gate_up, ndim=3)
    _checks.check_floating("w_down", w_down, ndim=3)
    num_tokens, d = x.shape
    num_experts, d_w, two_n = w_gate_up.shape
    if num_experts != plan.num_experts:
        raise ValueError(
            f"w_gate_up has {num_experts} experts (shape {w_gate_up.shape}) but the plan routes "
            f"to E={plan.num_experts}."
        )
    if d_w != d:
        raise ValueError(f"w_gate_up must be [E, d, 2n] with d={d} from x; got {w_gate_up.shape}.")
    if two_n % 2:
        raise ValueError(f"w_gate_up's last dim must be 2n (gate then up), got odd {two_n}.")
    n = two_n // 2
    if w_down.shape != (num_experts, n, d):
        raise ValueError(f"w_down must be [E, n, d] = {(num_experts, n, d)}, got {w_down.shape}.")
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise TypeError(
            "x, w_gate_up and w_down must share one dtype (cast the weights to the compute "
            f"dtype first); got {x.dtype}, {w_gate_up.dtype}, {w_down.dtype}."
        )
    if plan.num_tokens != num_tokens:
        raise ValueError(f"plan was built for T={plan.num_tokens} tokens but x has T={num_tokens}.")
    if plan.scores.shape != (plan.capacity,) or plan.rows_by_token.shape != (plan.capacity,):
        raise ValueError("plan is malformed: token_ids, scores and rows_by_token must share shape [P].")


# What the kernels take (their own checks name the argument when asked for explicitly).
KERNEL_DTYPE = jnp.bfloat16
KERNEL_WIDTH_MULTIPLE = 64


def resolve_backend(backend: str, x: jax.Array | None = None, w_down: jax.Array | None = None) -> str:
    """Maps "auto" to "mosaic" where the kernels apply, and to "xla" elsewhere.

    The kernels apply on a Hopper GPU (compute capability 9.0) to bf16 inputs whose widths
    `d` and `n` are multiples of 64. An explicit "mosaic" outside that raises instead.
    """
    _checks.check_choice("backend", backend, BACKENDS)
    if backend != "auto":
        return backend
    device = jax.devices()[0]
    if device.platform != "gpu" or getattr(device, "compute_capability", "") != "9.0":
        return "xla"
    if x is not None and w_down is not None:
        n, d = w_down.shape[1:]
        if x.dtype != KERNEL_DTYPE or d % KERNEL_WIDTH_MULTIPLE or n % KERNEL_WIDTH_MULTIPLE:
            return "xla"
    return "mosaic"


def moe_ffn(
    x: jax.Array,
    plan: DispatchPlan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    backend: Backend = "auto",
    numerics: Numerics | None = None,
) -> jax.Array:
    """SwiGLU Mixture-of-Experts feed-forward over a dispatch plan.

    `O[t] = sum over rows r of token t of s[r] * (silu(X W1g) * (X W1u))[r] @ W2[e(r)]`.

    Args:
      x: [T, d] tokens (bf16 on the GPU kernels; any float dtype on `xla`).
      plan: a `DispatchPlan` from `pm.routing.topk_plan` or `token_rounding_plan`.
      w_gate_up: [E, d, 2n], gate = `[..., :n]`, up = `[..., n:]`, same dtype as x.
      w_down: [E, n, d], same dtype as x.
      backend: "xla" (pure jnp, runs anywhere), "mosaic" (Pallas Mosaic GPU kernels on
        Hopper; bf16, d and n multiples of 64), "interpret" (the same kernels in GPU
        interpret mode on CPU), or "auto" ("mosaic" where it applies, else "xla").
      numerics: `pm.Numerics` switches (default `Numerics()`): the aggregation order
        ("fp32", "bf16_per_expert", "bf16_scores"; the bf16 modes need bf16 x) and
        whether the kernels fuse SwiGLU into the up-proj epilogue. Every backend computes
        the same aggregation order; see `pallas_moe.numerics` for the backward of each.

    Returns:
      [T, d] in x.dtype. Differentiable in x, both weights and `plan.scores`.
    """
    check_moe_inputs(x, plan, w_gate_up, w_down)
    numerics = check_numerics(numerics)
    check_activation_dtype(numerics, x.dtype)
    backend = resolve_backend(backend, x, w_down)
    if backend == "xla":
        return moe_ffn_xla(x, plan, w_gate_up, w_down, aggregation=numerics.aggregation)
    from pallas_moe.ops.mosaic import moe_ffn_kernels  # Pallas is imported only when used.

    return moe_ffn_kernels(
        x, plan, w_gate_up, w_down, interpret=backend == "interpret", numerics=numerics
    )
