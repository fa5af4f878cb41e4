"""XLA_FLAGS, the environment variable XLA reads once, when JAX creates a backend.

`add_xla_flag` appends a flag unless the caller already set that flag (to any value): a
caller's own choice wins. Used for the GPU ragged collective's implementation
(`pallas_moe.nn.use_fast_ragged_all_to_all`) and the test suite's CPU compile level.
"""

from __future__ import annotations

import os

from jax._src import xla_bridge  # backends_are_initialized has no public equivalent


def _name(flag: str) -> str:
    """"--xla_foo=1" -> "xla_foo"."""
    return flag.lstrip("-").split("=", 1)[0]


def has_xla_flag(name: str) -> bool:
    """Whether XLA_FLAGS sets the flag `name` ("xla_foo", no dashes), to any value."""
    return any(_name(flag) == name for flag in os.environ.get("XLA_FLAGS", "").split())


def add_xla_flag(flag: str) -> None:
    """Appends `flag` ("--xla_foo=value") to XLA_FLAGS unless that flag is set already.
    It takes effect only if JAX has not created its backend yet."""
    if not has_xla_flag(_name(flag)):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def backends_started() -> bool:
    """Whether JAX has created its backends, after which XLA no longer reads XLA_FLAGS."""
    return xla_bridge.backends_are_initialized()
