"""`moe_ffn` over the Pallas kernels, as a `jax.custom_vjp` with minimal residuals.

The forward saves only `X`, `H [P, 2n]`, the plan and (for the kernels) the plan's tile
metadata (the weights and the optional expert biases are inputs); `Y` and the gathered `X`
are never residuals. H is the biased pre-activation, so the backward recomputes A from it. The backward follows `docs/math.md`
(minimal-activation backward) without `Y`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_moe.numerics import Numerics, multiplied_scores
from pallas_moe.ops.activation import SwiGLU
from pallas_moe.ops.minimal_backward import moe_ffn_backward
from pallas_moe.routing.plan import DispatchPlan

# forward(x, plan, w_gate_up, w_down[, b_gate_up=, b_down=]) -> (out [T, d], h [P, 2n])
Forward = Callable[..., tuple[jax.Array, jax.Array]]
# backward(x, h, plan, w_gate_up, w_down, grad_out[, b_down=])
#   -> (dx, d_scores, dw_gate_up, dw_down[, db_gate_up, db_down])
Backward = Callable[..., tuple[jax.Array, ...]]


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
    schedules: Callable[[DispatchPlan, jax.Array, bool], object] | None = None,
    inference_forward: Forward | None = None,
):
    """Wraps a forward that returns `(out, h)` into a differentiable `moe_ffn`.

    Args:
      forward: `(x, plan, w_gate_up, w_down) -> (out [T, d], h [P, 2n])`; called with
        `b_gate_up=`, `b_down=` keywords when the layer has expert biases.
      backward: the minimal-activation backward, with the contract of `moe_ffn_backward`
        (its jnp implementation is the default; it gets `b_down=` with expert biases).
      aggregation: the forward's aggregation mode (`pallas_moe.numerics`). The backward
        multiplies by the scores the forward multiplied by (bf16-rounded for
        "bf16_scores"), and the score gradient passes straight through that rounding.
      schedules: `(plan, w_gate_up, has_biases) -> metadata` (the kernels' `plan_schedules`), computed
        once per call and passed to both passes as `schedules=`; the backward gets the
        forward's, saved as a residual (small integer arrays), so no pass derives tile
        metadata itself. None: the passes take no schedules.
      inference_forward: the forward to run where the op is not differentiated (its `h`
        may be None, and is not kept), with `forward`'s arguments; the kernels' skips
        writing H there. None: `forward`.

    Returns:
      `f(x, plan, w_gate_up, w_down, b_gate_up=None, b_down=None) -> out`, a
      `jax.custom_vjp` whose only new residuals are `h` and the schedules (differentiable
      in the biases given).
    """

    def with_schedules(plan, w_gate_up, biases):
        has_biases = any(b is not None for b in biases)
        return {} if schedules is None else {"schedules": schedules(plan, w_gate_up, has_biases)}

    def run_forward(x, plan, w_gate_up, w_down, biases, shared, fwd=forward):
        b_gate_up, b_down = biases
        if b_gate_up is None and b_down is None:
            return fwd(x, plan, w_gate_up, w_down, **shared)
        return fwd(x, plan, w_gate_up, w_down, b_gate_up=b_gate_up, b_down=b_down, **shared)

    @jax.custom_vjp
    def moe_with_biases(x, plan, w_gate_up, w_down, biases):
        # Not differentiated (a custom_vjp runs its primal function only then): no H.
        shared = with_schedules(plan, w_gate_up, biases)
        return run_forward(x, plan, w_gate_up, w_down, biases, shared,
                           fwd=inference_forward or forward)[0]

    def moe_fwd(x, plan, w_gate_up, w_down, biases):
        shared = with_schedules(plan, w_gate_up, biases)
        out, h = run_forward(x, plan, w_gate_up, w_down, biases, shared)
        return out, (x, h, plan, w_gate_up, w_down, biases, shared)

    def moe_bwd(residuals, grad_out):
        x, h, plan, w_gate_up, w_down, (b_gate_up, b_down), shared = residuals
        plan_multiplied = plan.with_scores(multiplied_scores(plan.scores, aggregation))
        if b_gate_up is None and b_down is None:
            dx, d_scores, dw_gate_up, dw_down = backward(
                x, h, plan_multiplied, w_gate_up, w_down, grad_out, **shared
            )
            d_biases = (None, None)
        else:
            # The backward's contract: b_down (zeros for a layer with only b_gate_up) asks
            # for both bias gradients; a bias the layer does not have gets None.
            num_experts, _, d = w_down.shape
            b_down_or_zeros = b_down if b_down is not None else jnp.zeros((num_experts, d), x.dtype)
            dx, d_scores, dw_gate_up, dw_down, db_gate_up, db_down = backward(
                x, h, plan_multiplied, w_gate_up, w_down, grad_out, b_down=b_down_or_zeros,
                **shared,
            )
            d_biases = (
                None if b_gate_up is None else db_gate_up.astype(b_gate_up.dtype),
                None if b_down is None else db_down,
            )
        return dx, plan_cotangent(plan, d_scores), dw_gate_up, dw_down, d_biases

    moe_with_biases.defvjp(moe_fwd, moe_bwd)

    def moe(x, plan, w_gate_up, w_down, b_gate_up=None, b_down=None):
        return moe_with_biases(x, plan, w_gate_up, w_down, (b_gate_up, b_down))

    return moe


@functools.cache
def _kernel_moe_ffn(interpret: bool, config, numerics: Numerics, activation: SwiGLU):
    # Pallas is imported only when a kernel backend is used.
    from pallas_moe.kernels.moe_backward import backward_config, moe_backward
    from pallas_moe.kernels.moe_forward import forward_config, moe_forward
    from pallas_moe.kernels.schedules import plan_schedules

    # The configs both passes and their schedules use.
    def forward_cfg(plan, w_gate_up, has_biases: bool):
        """With no forward config, a small batch's forward is the decode megakernel where it
        can run (`forward_config`: no expert biases, SwiGLU fused)."""
        _, d, two_n = w_gate_up.shape
        return forward_config(
            config.forward, d, two_n // 2, interpret, num_tokens=plan.num_tokens,
            megakernel=numerics.fuse_swiglu and not has_biases,
        )

    def backward_cfg(w_gate_up):
        _, d, two_n = w_gate_up.shape
        return backward_config(config.backward, d, two_n // 2, interpret)

    def forward(x, plan, w_gate_up, w_down, *, schedules, inference=False, **biases):
        return moe_forward(
            x, plan, w_gate_up, w_down, interpret=interpret,
            config=forward_cfg(plan, w_gate_up, bool(biases)), inference=inference,
            aggregation=numerics.aggregation, fuse_swiglu=numerics.fuse_swiglu,
            activation=activation, schedules=schedules, **biases,
        )

    def backward(x, h, plan, w_gate_up, w_down, grad_out, *, schedules, **b_down):
        return moe_backward(
            x, h, plan, w_gate_up, w_down, grad_out, interpret=interpret,
            config=backward_cfg(w_gate_up), activation=activation, schedules=schedules,
            **b_down,
        )

    return minimal_residual_moe_ffn(
        forward, backward, aggregation=numerics.aggregation,
        schedules=lambda plan, w_gate_up, has_biases: plan_schedules(
            plan, forward_cfg(plan, w_gate_up, has_biases), backward_cfg(w_gate_up),
            interpret=interpret,
        ),
        inference_forward=functools.partial(forward, inference=True),
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
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
) -> jax.Array:
    """`moe_ffn` through the Mosaic GPU kernels (`interpret=True`: GPU interpret mode on CPU).

    `config`: a `pallas_moe.kernels.KernelConfig` (None: every kernel's `for_shape` defaults).
    `b_gate_up` [E, 2n], `b_down` [E, d]: optional expert biases (bf16); `activation`: the
    `SwiGLU` spec. Both live in the kernels' epilogues (`kernels.moe_forward`,
    `kernels.moe_backward`).
    """
    from pallas_moe.kernels.config import KernelConfig

    return _kernel_moe_ffn(interpret, config or KernelConfig(), numerics, activation)(
        x, plan, w_gate_up, w_down, b_gate_up, b_down
    )
