"""`moe_ffn` over the Pallas kernels, as a `jax.custom_vjp` with minimal residuals.

The forward saves only `X`, `H [P, 2n]`, the plan and (for the kernels) the plan's tile
metadata (the weights are inputs); `Y` and the gathered `X` are never residuals. The
backward follows `docs/math.md` (minimal-activation backward) without `Y`.
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
    forward: Forward,
    backward: Backward = moe_ffn_backward,
    *,
    aggregation: str = "fp32",
    schedules: Callable[[DispatchPlan, jax.Array], object] | None = None,
):
    """Wraps a forward that returns `(out, h)` into a differentiable `moe_ffn`.

    Args:
      forward: `(x, plan, w_gate_up, w_down) -> (out [T, d], h [P, 2n])`.
      backward: the minimal-activation backward, with the contract of `moe_ffn_backward`
        (its jnp implementation is the default).
      aggregation: the forward's aggregation mode (`pallas_moe.numerics`). The backward
        multiplies by the scores the forward multiplied by (bf16-rounded for
        "bf16_scores"), and the score gradient passes straight through that rounding.
      schedules: `(plan, w_gate_up) -> metadata` (the kernels' `plan_schedules`), computed
        once per call and passed to both passes as `schedules=`; the backward gets the
        forward's, saved as a residual (small integer arrays), so no pass derives tile
        metadata itself. None: the passes take no schedules.

    Returns:
      `f(x, plan, w_gate_up, w_down) -> out`, a `jax.custom_vjp` whose only new residuals are
      `h` and the schedules.
    """

    def with_schedules(plan, w_gate_up):
        return {} if schedules is None else {"schedules": schedules(plan, w_gate_up)}

    @jax.custom_vjp
    def moe(x, plan, w_gate_up, w_down):
        return forward(x, plan, w_gate_up, w_down, **with_schedules(plan, w_gate_up))[0]

    def moe_fwd(x, plan, w_gate_up, w_down):
        shared = with_schedules(plan, w_gate_up)
        out, h = forward(x, plan, w_gate_up, w_down, **shared)
        return out, (x, h, plan, w_gate_up, w_down, shared)

    def moe_bwd(residuals, grad_out):
        x, h, plan, w_gate_up, w_down, shared = residuals
        plan_multiplied = plan.with_scores(multiplied_scores(plan.scores, aggregation))
        dx, d_scores, dw_gate_up, dw_down = backward(
            x, h, plan_multiplied, w_gate_up, w_down, grad_out, **shared
        )
        return dx, plan_cotangent(plan, d_scores), dw_gate_up, dw_down

    moe.defvjp(moe_fwd, moe_bwd)
    return moe


@functools.cache
def _kernel_moe_ffn(interpret: bool, config, numerics: Numerics):
    # Pallas is imported only when a kernel backend is used.
    from pallas_moe.kernels.moe_backward import backward_config, moe_backward
    from pallas_moe.kernels.moe_forward import forward_config, moe_forward
    from pallas_moe.kernels.schedules import plan_schedules

    def configs(w_gate_up):
        """The (forward, backward) configs both passes and their schedules use."""
        _, d, two_n = w_gate_up.shape
        return (forward_config(config.forward, d, two_n // 2, interpret),
                backward_config(config.backward, d, two_n // 2, interpret))

    def forward(x, plan, w_gate_up, w_down, *, schedules):
        return moe_forward(
            x, plan, w_gate_up, w_down, interpret=interpret, config=configs(w_gate_up)[0],
            aggregation=numerics.aggregation, fuse_swiglu=numerics.fuse_swiglu,
            schedules=schedules,
        )

    def backward(x, h, plan, w_gate_up, w_down, grad_out, *, schedules):
        return moe_backward(
            x, h, plan, w_gate_up, w_down, grad_out, interpret=interpret,
            config=configs(w_gate_up)[1], schedules=schedules,
        )

    return minimal_residual_moe_ffn(
        forward, backward, aggregation=numerics.aggregation,
        schedules=lambda plan, w_gate_up: plan_schedules(plan, *configs(w_gate_up)),
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
