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


# XLA's LLVM optimization level for CPU programs on a machine with no NVIDIA GPU (CI's).
# The suite's CPU programs are compiled once and run on small shapes (interpret-mode
# kernels, references), so compiling them unoptimized pays: the whole suite on a 2-core
# machine took 986 s (clean compile cache) against 1267 s at XLA's default level (a cache
# left from earlier runs; session 33, 686 passed both ways). It changes how XLA compiles,
# not what a program computes (every bitwise test passes at both levels). On a GPU machine
# the flag would also lower the GPU backend's level, so it is left alone there.
CPU_XLA_FLAGS = "--xla_backend_optimization_level=0"


def _cpu_compile_flags():
    """Adds `CPU_XLA_FLAGS` to XLA_FLAGS (read when JAX first creates a backend, so this
    runs before any test; subprocesses inherit it) unless a GPU is present or the caller
    already set the level."""
    if os.path.exists("/dev/nvidiactl"):
        return
    from pallas_moe._xla_flags import add_xla_flag

    add_xla_flag(CPU_XLA_FLAGS)


def _cpu_thread_pool():
    """Sets PJRT_NPROC (XLA's CPU thread pool size, read when JAX creates its CPU client,
    ahead of NPROC; subprocesses inherit it) to `INTERPRET_MIN_CPU_THREADS` unless the
    caller set it. Mosaic GPU interpret mode's simulated warpgroups block in host callbacks
    on that pool (`pallas_moe.kernels._common.interpret_params`); on CI's 2 cores (2
    threads) a jitted interpret backward stalled with no CPU use (session 44's CI; with a
    1-thread pool, `NPROC=1`, it stalls every time, and with PJRT_NPROC=32 it passes). Idle
    threads cost nothing measurable: the 50 tests of test_kernels_bwd and
    test_moe_ffn_kernels took 272 s at the default and 282 s at 32, one run each."""
    if "PJRT_NPROC" in os.environ:
        return
    from pallas_moe._xla_flags import backends_started
    from pallas_moe.kernels._common import INTERPRET_MIN_CPU_THREADS

    if backends_started():
        raise RuntimeError("PJRT_NPROC must be set before JAX creates its CPU client.")
    os.environ["PJRT_NPROC"] = str(INTERPRET_MIN_CPU_THREADS)


def pytest_configure(config):
    """A persistent XLA compilation cache in pytest's cache folder: the two xdist workers
    compile many of the same programs (the xla references, the routing at the same small
    shapes), and a second compile of one becomes a read; programs that call back into
    Python (interpret-mode kernels) are never cached. Keyed by the whole program, so it
    cannot change what runs."""
    _cpu_compile_flags()
    _cpu_thread_pool()
    if config.cache is None:
        return
    import jax

    cache_dir = str(config.cache.mkdir("jax_compilation_cache"))
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # Every program, however quick to compile: eager op-by-op dispatch compiles one small
    # program per primitive and shape (about 15,000 in a run, ~25 ms each, 40% of the
    # suite's compile time), and the two workers meet many of the same ones. A clean-cache
    # run is 8-10% faster with all of them cached than with only those above 0.2 s.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # The same cache for the Python subprocesses the tests start (they copy os.environ):
    # the four `tests.ep_check` processes build the same single-device reference layers
    # (top-K and token rounding on skewed inputs) and `tests.train_kill` trains the config
    # of test_train_reliability's reference run, so each such program compiles once per
    # suite instead of once per process. JAX reads these variables at import.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
