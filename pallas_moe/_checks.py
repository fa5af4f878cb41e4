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


def require(ok, message: str, **values) -> None:
    """Raises `ValueError(message)` where `ok` is False, on the host or on device.

    Eager (every input concrete): evaluates `ok` and raises at once. Traced: a
    `jax.experimental.checkify` check (wrap the jitted function in `checkify.checkify` and
    call `err.throw()`), so it needs no host callback and works under `shard_map`.

    Args:
      ok: bool[] condition.
      message: the error; `{name}` placeholders are filled from `values`.
      values: scalars the message reports (arrays or Python numbers).
    """
    traced = [v for v in (ok, *values.values()) if isinstance(v, jax.core.Tracer)]
    if traced:
        checkify.check(ok, message, **values)
    elif not bool(ok):
        raise ValueError(message.format(**{k: np.asarray(v).item() for k, v in values.items()}))


def check_finite_number(name: str, value, *, minimum: float | None = None, positive: bool = False) -> float:
    """Checks a scalar hyperparameter (a Python number or a concrete 0-d array).

    Returns it as a float. Rejects bools, non-numbers, NaN, +-Inf, values below `minimum`
    and (with `positive`) values <= 0, with an error that names `name`. A traced value is
    returned unchecked (it cannot be read under `jit`).
    """
    if isinstance(value, jax.core.Tracer):
        return value
    if isinstance(value, bool) or not (
        isinstance(value, (int, float, np.integer, np.floating))
        or (hasattr(value, "shape") and np.ndim(value) == 0)
    ):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    number = float(value)
    if not np.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}.")
    if positive and number <= 0:
        raise ValueError(f"{name} must be positive, got {number}.")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}.")
    return number


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
