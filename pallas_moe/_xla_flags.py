"""XLA_FLAGS, the environment variable XLA reads once, when JAX creates a backend.

`add_xla_flag` appends a flag unless the caller already set that flag (to any value): a
caller's own choice wins. Used for the GPU ragged collective's implementation
(`pallas_moe.nn.use_fast_ragged_all_to_all`) and the test suite's CPU compile level.
`xla_cpu_pool_threads` reads the other setting XLA takes from the environment at that
moment, its CPU thread pool's size (interpret mode needs a large one).
"""

from __future__ import annotations

import os

from jax._src import xla_bridge  # backends_are_initialized has no public equivalent


def _name(flag: str) -> str:
    """"--xla_foo=1" -> "xla_foo"."""
    return flag.lstrip("-").split("=", 1)[0]


def has_xla_flag(flag: str) -> bool:
    """Whether XLA_FLAGS sets `flag` ("xla_foo" or "--xla_foo=value": the name counts) to
    any value."""
    return any(_name(f) == _name(flag) for f in os.environ.get("XLA_FLAGS", "").split())


def add_xla_flag(flag: str) -> None:
    """Appends `flag` ("--xla_foo=value") to XLA_FLAGS unless that flag is set already.

    Raises RuntimeError if it would have to be added after JAX created its backends: XLA
    would ignore it (session 35 lost a benchmark run to that: a module import had started
    the backends before the flag was set, and the report printed the flag all the same)."""
    if has_xla_flag(flag):
        return
    if backends_started():
        raise RuntimeError(
            f"{flag} was added to XLA_FLAGS after JAX started its backends, so XLA would "
            "ignore it. Add it before the first jax.devices() or computation (at the top of "
            "the program), or put it in XLA_FLAGS before starting Python."
        )
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def backends_started() -> bool:
    """Whether JAX has created its backends, after which XLA no longer reads XLA_FLAGS."""
    return xla_bridge.backends_are_initialized()


def xla_cpu_pool_threads() -> int:
    """The size XLA gives its CPU intra-op thread pool when JAX creates the CPU client:
    PJRT_NPROC, else NPROC, else the cores this process may run on."""
    for var in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
