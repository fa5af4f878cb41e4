"""Input validation shared by routing, ops and the module. Errors name the argument."""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp


def _raise_if_nonfinite(name: str, has_nonfinite) -> None:
    if bool(has_nonfinite):
        raise ValueError(f"{name} contains NaN or Inf; routing needs finite values.")


def check_finite(name: str, value: jax.Array) -> None:
    """Raises ValueError if `value` has a NaN or Inf.

    Eagerly when `value` is concrete; under `jit` the check runs on the device and the
    error surfaces when the result is read (a host callback, so it also works in `grad`).
    """
    if isinstance(value, jax.core.Tracer):
        jax.debug.callback(
            lambda bad: _raise_if_nonfinite(name, bad), jnp.logical_not(jnp.all(jnp.isfinite(value)))
        )
    else:
        _raise_if_nonfinite(name, not np.all(np.isfinite(np.asarray(value, np.float32))))


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
