"""Expert parallelism across 2 processes on localhost (jax.distributed, gloo CPU collectives)
against the single-device layer; see `tests/multiprocess_check.py`."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(module: str, num_processes: int, devices_per_process: int, extra_args=(), timeout=900):
    """Starts `python -m module --process-id i --num-processes N --port P` N times; returns
    [(returncode, stdout, stderr)] per process."""
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--process-id", str(i), "--num-processes", str(num_processes),
             "--port", str(port), *extra_args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(num_processes)
    ]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            out.append((proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


def _results(out):
    results = []
    for returncode, stdout, stderr in out:
        assert returncode == 0, stdout + stderr[-4000:]
        results += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return results


def test_ep_across_two_processes():
    """The expert axis across the processes (ragged dispatch, chunked overlap, token
    rounding), and the data axis across them (all_gather dispatch, top-K)."""
    results = _results(run_processes("tests.multiprocess_check", 2, 2))
    assert len(results) == 4, results
    assert all(r["ok"] for r in results), json.dumps(results, indent=1)
    assert {r["process"] for r in results} == {0, 1}
    assert {tuple(r["mesh"]) for r in results} == {(1, 4), (2, 2)}


@pytest.mark.slow
def test_ep_across_two_processes_full():
    results = _results(run_processes("tests.multiprocess_check", 2, 2, ["--cases", "full"]))
    assert len(results) == 10 and all(r["ok"] for r in results), json.dumps(results, indent=1)
