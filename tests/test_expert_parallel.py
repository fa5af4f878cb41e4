"""Expert parallelism: EP layer vs single-device layer, and clear errors on bad layouts.

The numerical comparisons need 8 CPU devices, fixed when jax is imported, so they run in a
subprocess (`python -m tests.ep_check`); the error checks run here on one device.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import pallas_moe as pm

ROOT = Path(__file__).resolve().parents[1]


def _run_ep_check(cases: str):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ep_check", "--cases", cases],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, results


def _check(proc, results, min_cases):
    assert len(results) >= min_cases, proc.stdout + proc.stderr
    bad = [r for r in results if not r["ok"]]
    assert not bad, json.dumps(bad, indent=1)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_ep_matches_single_device():
    """EP 1/2/4 (8: the chunked test), top-K and token rounding, both dispatches, skewed
    routing: y, aux, grads.

    Also the layout errors on a real 2x3 mesh (experts or tokens not divisible) and the
    emulated collective against the `ragged_all_to_all` docstring example.
    """
    proc, results = _run_ep_check("fast")
    _check(proc, results, 8)  # 5 checks + the 3 FAST cases
    checks = {r["check"] for r in results if "check" in r}
    assert checks == {
        "experts_not_divisible", "tokens_not_divisible", "missing_axis", "valid_3way",
        "emulation_doc_example",
    }
    results = [r for r in results if "check" not in r]
    assert {r["ep"] for r in results} == {1, 2, 4}  # EP=8: test_ep_chunked_overlap_matches_single_device
    assert {r["dispatch"] for r in results} == {"all_gather", "emulated_ragged_all_to_all"}
    tr = [r for r in results if r["routing"] == "token_rounding"]
    assert any(r["added_rows"] > 0 and r["dropped_rows"] > 0 for r in tr)  # rounding both ways
    assert {r["dispatch"] for r in results if r.get("check_vma")} == {"all_gather"}


def test_ep_chunked_overlap_matches_single_device():
    """overlap="chunked" equals the single-device layer for top-K and token rounding, with
    the rows (ragged dispatch) or tokens (all-gather dispatch) really cut into several
    chunks, expert biases and the clamped SwiGLU included; the vma type check passes on
    both dispatches (a process of its own, so pytest-xdist runs it beside
    `test_ep_matches_single_device`)."""
    proc, results = _run_ep_check("chunked")
    _check(proc, results, 4)
    assert all(r.get("overlap") == "chunked" for r in results)
    assert {r["routing"] for r in results} == {"topk", "token_rounding"}
    assert all(r["chunks"] >= 3 for r in results)
    assert {r["ep"] for r in results} == {2, 4, 8}
    assert any(r.get("preset") == "biases_clamped" for r in results)
    assert {r["dispatch"] for r in results} == {"emulated_ragged_all_to_all", "all_gather"}
    assert {r["dispatch"] for r in results if r.get("check_vma")} == {"emulated_ragged_all_to_all", "all_gather"}


def test_ep_overlap_schedule():
    """In the compiled HLO (8 CPU devices), the shared MLP is independent of the dispatch
    collectives and chunk c's combine of chunk c+1's down-proj; hand-built programs
    without the overlap fail the same checks."""
    proc, results = _run_ep_check("schedule")
    _check(proc, results, 6)
    assert {r["check"] for r in results} == {
        "schedule_chunked", "schedule_all_gather", "schedule_all_gather_chunked",
        "negative_shared", "negative_chunks",
        "signal_primitives_lower",  # what overlap="signal" would need lowers for Hopper
    }


def test_ep_layouts():
    """EP layers inside `nnx.scan`, the ragged receive-capacity drop, explicit-sharding meshes;
    the GPU-only code (routing kernels, the real ragged collective's VJP) under
    `check_vma=True`, traced."""
    proc, results = _run_ep_check("layouts")
    _check(proc, results, 10)
    assert {r["check"] for r in results} == {
        "scan_ep", "capacity_drop", "capacity_ample", "explicit_mesh",
        "vma_softmax_kernel", "vma_topk_kernels", "vma_token_rounding_kernels", "vma_ragged_exchange_grad",
        "vma_ep_gpu_routing_topk", "vma_ep_gpu_routing_token_rounding",
    }


@pytest.mark.slow  # CI time: twins of default cases (see ep_check.FAST_EXTRA and eager_check)
def test_ep_matches_single_device_extra():
    """The opt-in rest of `test_ep_matches_single_device`: plain top-K through the all-gather
    dispatch at EP=2 under the vma check, token rounding through it at EP=4 and through the
    unchunked ragged dispatch at EP=8, gpt-oss's biases through the unchunked ragged
    dispatch, and the valid 3-way layout called outside jit."""
    proc, results = _run_ep_check("fast_extra")
    _check(proc, results, 5)
    assert {r["check"] for r in results if "check" in r} == {"valid_3way_eager"}
    results = [r for r in results if "check" not in r]
    assert {(r["dispatch"], r["ep"]) for r in results} == {
        ("all_gather", 2), ("all_gather", 4), ("emulated_ragged_all_to_all", 2),
        ("emulated_ragged_all_to_all", 8)}


@pytest.mark.slow
def test_ep_matches_single_device_full_matrix():
    proc, results = _run_ep_check("full")
    _check(proc, results, 60)


def _mesh(shape=(1,), names=("expert",)):
    return Mesh(np.array(jax.devices()[:1]).reshape(shape), names)


def test_missing_mesh_axis():
    with pytest.raises(ValueError, match="axis='expert'.*not an axis of the mesh"):
        pm.nn.ExpertParallel(_mesh(names=("data",)), axis="expert")
    with pytest.raises(ValueError, match="token_axes names 'batch'"):
        pm.nn.ExpertParallel(_mesh(), token_axes=("batch", "expert"))
    with pytest.raises(ValueError, match="must include the expert axis"):
        pm.nn.ExpertParallel(_mesh((1, 1), ("data", "expert")), token_axes=("data",))


def test_bad_dispatch_and_capacity():
    with pytest.raises(ValueError, match="dispatch must be one of"):
        pm.nn.ExpertParallel(_mesh(), dispatch="alltoall")
    with pytest.raises(ValueError, match="capacity_factor applies to the ragged dispatch only"):
        pm.nn.ExpertParallel(_mesh(), capacity_factor=1.5)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        pm.nn.ExpertParallel(_mesh(), dispatch="emulated_ragged_all_to_all", capacity_factor=0)


def test_bad_overlap():
    with pytest.raises(ValueError, match="overlap must be one of"):
        pm.nn.ExpertParallel(_mesh(), dispatch="emulated_ragged_all_to_all", overlap="async")
    with pytest.raises(ValueError, match=rf"overlap='signal'.*not available in JAX {re.escape(jax.__version__)}.*docs/ep_overlap.md.*overlap='chunked'"):
        pm.nn.ExpertParallel(_mesh(), dispatch="emulated_ragged_all_to_all", overlap="signal")
    chunked = pm.nn.ExpertParallel(_mesh(), dispatch="all_gather", overlap="chunked", num_chunks="auto")
    assert (chunked.overlap, chunked.num_chunks) == ("chunked", "auto")
    with pytest.raises(ValueError, match="num_chunks must be positive"):
        pm.nn.ExpertParallel(_mesh(), dispatch="emulated_ragged_all_to_all", overlap="chunked", num_chunks=0)
    with pytest.raises(TypeError, match="num_chunks must be a Python int"):
        pm.nn.ExpertParallel(_mesh(), dispatch="emulated_ragged_all_to_all", num_chunks=2.0)
    with pytest.raises(ValueError, match="num_chunks must be a positive int or 'auto', got 'many'"):
        pm.nn.ExpertParallel(_mesh(), dispatch="emulated_ragged_all_to_all", num_chunks="many")
    auto = pm.nn.ExpertParallel(_mesh(), dispatch="emulated_ragged_all_to_all", overlap="chunked", num_chunks="auto")
    assert auto.num_chunks == "auto"


def test_check_vma_with_kernels_is_a_clear_error():
    ep = pm.nn.ExpertParallel(_mesh(), check_vma=True)
    layer = pm.nn.MoE(64, 64, 4, 2, backend="interpret", dtype=jax.numpy.bfloat16, rngs=nnx.Rngs(0),
                      expert_parallel=ep)
    with pytest.raises(ValueError, match="check_vma=True\\) runs only with backend='xla'.*mpmd_map"):
        layer(jax.numpy.ones((8, 64)))
    with pytest.raises(TypeError, match="check_vma must be a bool"):
        pm.nn.ExpertParallel(_mesh(), check_vma=1)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU limitation only")
def test_ragged_all_to_all_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="XLA:CPU has no ragged_all_to_all"):
        pm.nn.ExpertParallel(_mesh(), dispatch="ragged_all_to_all")


def test_expert_parallel_type_checked():
    with pytest.raises(TypeError, match="expert_parallel must be a pallas_moe.nn.ExpertParallel"):
        pm.nn.MoE(16, 8, 8, 2, rngs=nnx.Rngs(0), expert_parallel="expert")


def test_fast_ragged_all_to_all_flag_is_added_once_and_its_absence_warns_on_gpus(monkeypatch):
    """XLA's default GPU ragged_all_to_all moved ~5 GB/s per GPU on two H200s (session 34):
    the ragged dispatch warns on a GPU mesh unless XLA_FLAGS picks the decomposer, and
    `use_fast_ragged_all_to_all` adds that flag, keeping the caller's others, once; after
    the backends have started it raises instead (XLA would ignore the flag)."""
    from pallas_moe.nn import expert_parallel as ep_module

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    with pytest.warns(UserWarning, match="ragged_all_to_all_decomposer=true"):
        ep_module.warn_if_slow_ragged_all_to_all("gpu")
    # This process's backends have started: XLA would ignore the flag, so it raises.
    with pytest.raises(RuntimeError, match="after JAX started its backends"):
        pm.nn.use_fast_ragged_all_to_all()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    from pallas_moe import _xla_flags

    monkeypatch.setattr(_xla_flags, "backends_started", lambda: False)
    pm.nn.use_fast_ragged_all_to_all()
    pm.nn.use_fast_ragged_all_to_all()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x " + ep_module.RAGGED_ALL_TO_ALL_GPU_FLAG
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ep_module.warn_if_slow_ragged_all_to_all("gpu")  # the flag is set: no warning
        monkeypatch.delenv("XLA_FLAGS")
        ep_module.warn_if_slow_ragged_all_to_all("tpu")  # TPUs have their own collective
        # A caller's own setting of the flag wins, and counts as a choice (no warning).
        monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=false")
        pm.nn.use_fast_ragged_all_to_all()
        assert os.environ["XLA_FLAGS"] == "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=false"
        ep_module.warn_if_slow_ragged_all_to_all("gpu")


def test_interpret_backend_over_several_devices_is_a_clear_error():
    """Mosaic GPU's interpreter under shard_map on several CPU devices hangs or fails an
    interpreter assertion (session 35, even with overlap="none"): refused up front. One
    device still runs (test_check_vma_with_kernels_is_a_clear_error's mesh)."""
    script = (
        "import jax, numpy as np\n"
        "from flax import nnx\n"
        "from jax.sharding import Mesh\n"
        "import pallas_moe as pm\n"
        "mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ('data', 'expert'))\n"
        "ep = pm.nn.ExpertParallel(mesh, dispatch='all_gather')\n"
        "layer = pm.nn.MoE(128, 64, 4, 2, backend='interpret', dtype=jax.numpy.bfloat16,\n"
        "                  rngs=nnx.Rngs(0), expert_parallel=ep)\n"
        "try:\n"
        "    layer(jax.numpy.ones((64, 128), jax.numpy.bfloat16))\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": "."}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    assert "refused: backend='interpret' cannot run expert parallelism over several devices" in done.stdout, (
        done.stdout[-2000:] + done.stderr[-2000:])
