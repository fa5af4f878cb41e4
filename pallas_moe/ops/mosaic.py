"""`moe_ffn` over the Pallas kernels, as a `jax.custom_vjp` with minimal residuals.

The forward saves only `X`, `H [P, 2n]` and the plan (the weights are inputs); `Y` and the
gathered `X` are never residuals. The backward follows `docs/math.md` (minimal-activation backward) without `Y`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from pallas_moe.numerics import Numerics, multiplied_scores
from pallas_moe.ops.minimal_backward import moe_ffn_backward
from pallas_moe.routing.plan import DispatchPlan

# forward(x, plan, w_gate_up, w_down) -> (out [T, d], h [P, 2n])
Forward = Callable[..., tuple[jax.Array, jax.Array]]
# backward(x, h, plan, w_gate_up, w_down, grad_out) -> (dx, d_scores, dw_gate_up, dw_down)
Backward = Callable[..., tuple[jax.Array, jax.Array, jax.Array, jax.Array]]


def _zero_cotangent(leaf: jax.Array) -> np.ndarray:
    return np.zeros(leaf.shape, jax.dtypes.float0)


def plan_cotangent(plan: DispatchPlan, d_scores: jax.Array) -> DispatchPlan:
    """Cotangent of a plan: `d_scores` for the scores, symbolic zeros for integer metadata."""
    zeros = jax.tree.map(_zero_cotangent, plan)
    return zeros.with_scores(d_scores.astype(plan.scores.dtype))


def minimal_residual_moe_ffn(
    forward: Forward, backward: Backward = moe_ffn_backward, *, aggregation: str = "fp32"
):
    """Wraps a forward that returns `(out, h)` into a differentiable `moe_ffn`.

    Args:
      forward: `(x, plan, w_gate_up, w_down) -> (out [T, d], h [P, 2n])`.
      backward: the minimal-activation backward, with the contract of `moe_ffn_backward`
        (its jnp implementation is the default).
      aggregation: the forward's aggregation mode (`pallas_moe.numerics`). The backward
        multiplies by the scores the forward multiplied by (bf16-rounded for
        "bf16_scores"), and the score gradient passes straight through that rounding.

    Returns:
      `f(x, plan, w_gate_up, w_down) -> out`, a `jax.custom_vjp` whose only new residual is `h`.
    """

    @jax.custom_vjp
    def moe(x, plan, w_gate_up, w_down):
        return forward(x, plan, w_gate_up, w_down)[0]

    def moe_fwd(x, plan, w_gate_up, w_down):
        out, h = forward(x, plan, w_gate_up, w_down)
        return out, (x, h, plan, w_gate_up, w_down)

    def moe_bwd(residuals, grad_out):
        x, h, plan, w_gate_up, w_down = residuals
        plan_multiplied = plan.with_scores(multiplied_scores(plan.scores, aggregation))
        dx, d_scores, dw_gate_up, dw_down = backward(
            x, h, plan_multiplied, w_gate_up, w_down, grad_out
        )
        return dx, plan_cotangent(plan, d_scores), dw_gate_up, dw_down

    moe.defvjp(moe_fwd, moe_bwd)
    return moe


@functools.cache
def _kernel_moe_ffn(interpret: bool, config, numerics: Numerics):
    # Pallas is imported only when a kernel backend is used.
    from pallas_moe.kernels.moe_backward import moe_backward
    from pallas_moe.kernels.moe_forward import moe_forward

    return minimal_residual_moe_ffn(
        functools.partial(
            moe_forward, interpret=interpret, config=config.forward,
            aggregation=numerics.aggregation, fuse_swiglu=numerics.fuse_swiglu,
        ),
        functools.partial(moe_backward, interpret=interpret, config=config.backward),
        aggregation=numerics.aggregation,
    )


def moe_ffn_kernels(
    x: jax.Array,
    plan: DispatchPlan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    interpret: bool,
    config=None,
    numerics: Numerics = Numerics(),
) -> jax.Array:
    """`moe_ffn` through the Mosaic GPU kernels (`interpret=True`: GPU interpret mode on CPU).

    `config`: a `pallas_moe.kernels.KernelConfig` (None: every kernel's `for_shape` defaults).
    """
    from pallas_moe.kernels.config import KernelConfig

    return _kernel_moe_ffn(interpret, config or KernelConfig(), numerics)(
        x, plan, w_gate_up, w_down
    )
