"""Input validation shared by routing, ops and the module. Errors name the argument."""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import checkify


def _raise_if_nonfinite(name: str, has_nonfinite) -> None:
    if bool(has_nonfinite):
        raise ValueError(f"{name} contains NaN or Inf; routing needs finite values.")


def check_finite(name: str, value: jax.Array, mode: bool | None = None) -> None:
    """Checks that `value` holds no NaN or Inf, without a host round trip under `jit`.

    Args:
      name: the argument's name, used in the error.
      value: the array to check.
      mode: None (default): check concrete (eager) values, raising ValueError; skip traced
        ones, so a jitted step pays nothing. True: also check traced values, through
        `jax.experimental.checkify` (wrap the jitted function in `checkify.checkify` and
        call `err.throw()`; staging it without checkify raises a ValueError that says so).
        Works under `grad` and `shard_map`, with no host callback. False: never check.
    """
    if mode is False:
        return
    if not isinstance(value, jax.core.Tracer):
        _raise_if_nonfinite(name, not np.all(np.isfinite(np.asarray(value, np.float32))))
    elif mode:
        nonfinite = jnp.sum(jnp.logical_not(jnp.isfinite(value)), dtype=jnp.int32)
        checkify.check(
            nonfinite == 0, f"{name} contains {{count}} NaN or Inf values; routing needs finite values.",
            count=nonfinite,
        )


def check_floating(name: str, value: jax.Array, ndim: int | None = None) -> None:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(value).__name__}.")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}.")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array, got dtype {value.dtype}.")


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}.")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}.")
    return int(value)


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}.")
