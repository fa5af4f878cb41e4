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


def run_processes(argv_of, num_processes: int, devices_per_process: int, timeout=900):
    """Starts `python <argv_of(i, port)>` for i in 0..N-1, each with its own CPU devices;
    returns [(returncode, stdout, stderr)] per process."""
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *argv_of(i, port)],
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


def ep_check_argv(*extra):
    return lambda i, port: [
        "-m", "tests.multiprocess_check", "--process-id", str(i), "--num-processes", "2",
        "--port", str(port), *extra,
    ]


@pytest.mark.slow  # 2 processes x 2 CPU devices, ~50 s on 2 cores; one-process EP is tested in CI
def test_ep_across_two_processes():
    """The expert axis across the processes (ragged dispatch, chunked overlap, token
    rounding), and the data axis across them (all_gather dispatch, top-K)."""
    results = _results(run_processes(ep_check_argv(), 2, 2))
    assert len(results) == 4, results
    assert all(r["ok"] for r in results), json.dumps(results, indent=1)
    assert {r["process"] for r in results} == {0, 1}
    assert {tuple(r["mesh"]) for r in results} == {(1, 4), (2, 2)}


@pytest.mark.slow
def test_ep_across_two_processes_full():
    results = _results(run_processes(ep_check_argv("--cases", "full"), 2, 2))
    assert len(results) == 10 and all(r["ok"] for r in results), json.dumps(results, indent=1)


# A tiny model: one MoE block, 3 steps, a checkpoint at step 2 and at the end.
TRAIN_ARGS = [
    "-m", "train.main", "--config", "tiny", "--steps", "3", "--checkpoint-every", "2", "--no-progress",
    *[f"--set={kv}" for kv in (
        "d_model=32", "num_layers=1", "d_expert=32", "num_heads=2", "seq_len=32", "batch_size=8",
        "log_every=1", "eval_every=3", "eval_batches=1", "max_train_bytes=200000",
    )],
]


@pytest.mark.slow  # 64 s on the shared 2-core CI machine (three processes compile the model)
def test_train_across_two_processes(tmp_path):
    """`train.main` on 2 processes x 2 CPU devices (EP=2 over the (data, expert) mesh,
    ragged dispatch, chunked overlap) follows the one-device run step for step."""
    parallel = [
        "--set=devices=0", "--set=expert_parallel=2", "--set=dispatch=emulated_ragged_all_to_all",
        "--set=overlap=chunked",
    ]
    out = run_processes(
        lambda i, port: [
            *TRAIN_ARGS, *parallel, "--out", str(tmp_path / "ep"),
            "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i),
        ],
        2, 2,
    )
    for returncode, stdout, stderr in out:
        assert returncode == 0, stdout + stderr[-4000:]
    single = run_processes(lambda i, port: [*TRAIN_ARGS, "--out", str(tmp_path / "one")], 1, 1)
    assert single[0][0] == 0, single[0][1] + single[0][2][-4000:]

    def records(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    ep, one = records("ep"), records("one")
    info = [r for r in ep if r["split"] == "info"][0]
    assert info["processes"] == 2 and info["devices"].count("CpuDevice") == 4
    steps = lambda rs, split: {r["step"]: r for r in rs if r["split"] == split}
    ep_train, one_train = steps(ep, "train"), steps(one, "train")
    assert sorted(ep_train) == sorted(one_train) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("ce", "aux_loss", "grad_norm"):
            assert abs(ep_train[step][key] - one_train[step][key]) <= 1e-5 * abs(one_train[step][key]), (step, key)
    for step, rec in steps(one, "val").items():
        assert abs(steps(ep, "val")[step]["val_loss"] - rec["val_loss"]) <= 1e-5 * rec["val_loss"]
    assert (tmp_path / "ep" / "checkpoints" / "3").is_dir()
