"""`pm.moe_ffn`: the differentiable MoE feed-forward over a dispatch plan."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_moe import _checks
from pallas_moe.numerics import Numerics, check_activation_dtype, check_numerics
from pallas_moe.ops.activation import SwiGLU, check_activation
from pallas_moe.ops.xla import moe_ffn_xla
from pallas_moe.routing.plan import DispatchPlan, validate_plan

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


def check_expert_biases(
    x: jax.Array, w_gate_up: jax.Array, b_gate_up: jax.Array | None, b_down: jax.Array | None
) -> None:
    """Raises a clear error when the optional expert biases do not fit `[E, 2n]` / `[E, d]`."""
    num_experts, d, two_n = w_gate_up.shape
    for name, bias, shape in (
        ("b_gate_up", b_gate_up, (num_experts, two_n)),
        ("b_down", b_down, (num_experts, d)),
    ):
        if bias is None:
            continue
        _checks.check_floating(name, bias, ndim=2)
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be [E, {'2n' if name == 'b_gate_up' else 'd'}] = {shape}, got {tuple(bias.shape)}.")
        if bias.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype} (cast it like the weights), got {bias.dtype}.")


# What the kernels take (their own checks name the argument when asked for explicitly).
KERNEL_DTYPE = jnp.bfloat16
KERNEL_WIDTH_MULTIPLE = 64


HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


def on_hopper() -> bool:
    """Whether the target device is a Hopper GPU (compute capability 9.0).

    The target is the abstract device of the current abstract mesh when one is set (JAX's
    way to name an ahead-of-time target, e.g. lowering for cuda on a CPU host under
    `jax.sharding.use_abstract_mesh`), else the default device.
    """
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract.platform in ("gpu", "cuda") and any(
            kind in abstract.device_kind for kind in HOPPER_KINDS
        )
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def resolve_backend(backend: str, x: jax.Array | None = None, w_down: jax.Array | None = None) -> str:
    """Maps "auto" to "mosaic" where the kernels apply, and to "xla" elsewhere.

    The kernels apply on a Hopper GPU (`on_hopper`) to bf16 inputs whose widths `d` and `n`
    are multiples of 64. An explicit "mosaic" without a Hopper target raises a `ValueError`
    (the kernels' own checks name a wrong dtype or width).
    """
    _checks.check_choice("backend", backend, BACKENDS)
    hopper = on_hopper()
    if backend == "mosaic" and not hopper:
        device = jax.devices()[0]
        found = f"{device.platform} device {getattr(device, 'device_kind', '')!r}"
        raise ValueError(
            "backend='mosaic' needs a Hopper GPU (compute capability 9.0, sm_90a); the default "
            f"device here is a {found}. Use backend='auto' or 'xla' (or 'interpret' to run "
            "the kernels in GPU interpret mode on CPU, slowly). To lower for a Hopper GPU from "
            "this host, name it as the abstract device of `jax.sharding.use_abstract_mesh`."
        )
    if backend != "auto":
        return backend
    if not hopper:
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
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
    backend: Backend = "auto",
    config=None,
    validate: bool = False,
    numerics: Numerics | None = None,
) -> jax.Array:
    """Gated (SwiGLU) Mixture-of-Experts feed-forward over a dispatch plan.

    `O[t] = sum over rows r of token t of s[r] * (act(X W1[e] + b1[e]) @ W2[e] + b2[e])[r]`,
    with `act(h) = silu(h[:n]) * h[n:]` by default.

    Args:
      x: [T, d] tokens (bf16 on the GPU kernels; any float dtype on `xla`).
      plan: a `DispatchPlan` from `pm.routing.topk_plan` or `token_rounding_plan`.
      w_gate_up: [E, d, 2n], gate = `[..., :n]`, up = `[..., n:]`, same dtype as x.
      w_down: [E, n, d], same dtype as x.
      b_gate_up: optional [E, 2n] expert bias of the up-projection (gate half first), x's dtype.
      b_down: optional [E, d] expert bias of the down-projection, x's dtype.
      activation: a `pm.ops.activation.SwiGLU` spec: `SwiGLU()` (silu, default) or
        `SwiGLU.clamped(alpha=1.702, limit=7.0)` (gpt-oss).
      backend: "xla" (pure jnp, runs anywhere), "mosaic" (Pallas Mosaic GPU kernels on
        Hopper; bf16, d and n multiples of 64), "interpret" (the same kernels in GPU
        interpret mode on CPU), or "auto" ("mosaic" where it applies, else "xla").
      config: a `pallas_moe.kernels.KernelConfig` with the kernels' block sizes and row
        loader (None: `for_shape` defaults, and for the smallest batches without expert
        biases the decode megakernel forward, which measured faster there: T <= 2 on an
        H100, T <= 32 on an H200; see `kernels.moe_forward.decode_max_tokens`). Used by the
        kernel backends; with an explicit `backend="xla"` it is an error, with "auto" it
        is ignored where "xla" is chosen.
        Every backend implements the expert biases and both activations (the kernels in
        their epilogues and backward), so they never change what "auto" picks.
      validate: check the plan's values with `pm.routing.validate_plan` first (for hand-built
        plans; eager: `ValueError`, under `jit`: a checkify check). Off by default: plans from
        `topk_plan` / `token_rounding_plan` are valid by construction.
      numerics: `pm.Numerics` switches (default `Numerics()`): the aggregation order
        ("fp32", "bf16_per_expert", "bf16_scores"; the bf16 modes need bf16 x) and
        whether the kernels fuse SwiGLU into the up-proj epilogue. Every backend computes
        the same aggregation order; see `pallas_moe.numerics` for the backward of each.

    Returns:
      [T, d] in x.dtype. Differentiable in x, both weights, both biases and `plan.scores`.
    """
    check_moe_inputs(x, plan, w_gate_up, w_down)
    if config is not None:
        from pallas_moe.kernels.config import KernelConfig

        if not isinstance(config, KernelConfig):
            raise TypeError(
                f"config must be a pallas_moe.kernels.KernelConfig or None, got {type(config).__name__}."
            )
        if backend == "xla":
            raise ValueError("config sets kernel block sizes; backend='xla' runs no kernels.")
    numerics = check_numerics(numerics)
    check_activation_dtype(numerics, x.dtype)
    check_expert_biases(x, w_gate_up, b_gate_up, b_down)
    activation = check_activation(activation)
    if validate:
        validate_plan(plan, x.shape[0])
    backend = resolve_backend(backend, x, w_down)
    if backend == "xla":
        return moe_ffn_xla(
            x, plan, w_gate_up, w_down, b_gate_up=b_gate_up, b_down=b_down, activation=activation,
            aggregation=numerics.aggregation,
        )
    from pallas_moe.ops.mosaic import moe_ffn_kernels  # Pallas is imported only when used.

    return moe_ffn_kernels(
        x, plan, w_gate_up, w_down, interpret=backend == "interpret", config=config,
        numerics=numerics, b_gate_up=b_gate_up, b_down=b_down, activation=activation,
    )
