"""Shared test settings: hypothesis profiles sized for a 2-core CI machine."""

import os

from hypothesis import HealthCheck, settings

# Every new (T, E, K, tile) compiles fresh XLA programs, so examples are few and slow.
settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("ci")


def pytest_configure(config):
    """A persistent XLA compilation cache in pytest's cache folder: the two xdist workers
    compile many of the same programs (the xla references, the routing at the same small
    shapes), and a second compile of one becomes a read; programs that call back into
    Python (interpret-mode kernels) are never cached. Keyed by the whole program, so it
    cannot change what runs."""
    if config.cache is None:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", str(config.cache.mkdir("jax_compilation_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
