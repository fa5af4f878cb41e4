"""The benchmarks' trace analysis, on hand-made event lists (start ns, end ns, name):
which kernels ran side by side on different streams (`benchmarks/step.py`'s
`concurrent_kernels`), and how much of each collective the layer's kernels hid
(`benchmarks/ep.py`'s `hidden_collective_time`)."""
from benchmarks.ep import hidden_collective_time, is_collective_event
from benchmarks.step import concurrent_kernels


def test_serial_kernels_never_overlap():
    events = [(0, 10, "a"), (10, 25, "b"), (30, 40, "c")]
    assert concurrent_kernels(events) == {}


def test_overlaps_are_summed_per_pair_and_clipped_to_the_shorter_event():
    events = sorted([
        (0, 100, "moe_up_proj(x)"),  # a long kernel, its argument list dropped from the key
        (20, 30, "fusion.1"),  # wholly inside it: 10 ns
        (90, 120, "fusion.1"),  # starts inside, ends after: 10 ns more
        (95, 99, "copy"),  # inside both the up-proj and the second fusion
        (200, 210, "fusion.1"),  # alone
    ])
    overlaps = concurrent_kernels(events)
    assert overlaps == {("moe_up_proj", "fusion.1"): 20, ("moe_up_proj", "copy"): 4,
                        ("fusion.1", "copy"): 4}


def test_an_event_ending_exactly_at_a_start_is_not_running():
    assert concurrent_kernels([(0, 5, "a"), (5, 9, "b"), (5, 7, "c")]) == {("b", "c"): 2}


def test_collective_events_are_told_from_the_layers_kernels():
    for name in ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "ncclKernel_AllGather_RING_LL",
                 "ragged_all_to_all_kernel", "MemcpyP2P", "Memcpy PtoP"):
        assert is_collective_event(name), name
    for name in ("moe_up_proj", "fusion.12", "loop_reduce_fusion", "Memcpy DtoD", "cutlass_gemm"):
        assert not is_collective_event(name), name


def test_hidden_time_is_the_collectives_overlap_with_the_union_of_other_kernels():
    events = sorted([
        (0, 100, "ncclDevKernel_SendRecv"),  # the dispatch: the shared MLP hides 40 of 100 ns
        (10, 30, "shared_mlp_fusion"),
        (20, 50, "shared_mlp_fusion.2"),  # overlaps the first: counted once
        (100, 200, "moe_down_proj"),
        (150, 260, "ncclDevKernel_SendRecv"),  # a combine: 50 ns beside the down-proj, 60 exposed
        (300, 310, "ncclKernel_AllReduce"),  # nothing beside it
    ])
    assert hidden_collective_time(events) == [
        (0, 100, "ncclDevKernel_SendRecv", 40),
        (150, 110, "ncclDevKernel_SendRecv", 50),
        (300, 10, "ncclKernel_AllReduce", 0),
    ]


def test_ep_report_tables_a_traced_row_an_error_and_a_check():
    """`benchmarks/ep.py`'s markdown report with the rows a GPU run gives (call 2 of session
    34 wrote its tables only after this was fixed: a loop variable had shadowed the device)."""
    import argparse

    import jax.numpy as jnp

    from benchmarks.ep import report

    args = argparse.Namespace(shape="32768,4096,512,128,8", backend="mosaic", routing="topk", skew=False,
                              shared_experts=1, param_dtype=jnp.dtype(jnp.bfloat16), iters=10,
                              weak_tokens=4096, num_chunks=2, check_shape="4096,1024,256,16,4")
    trace = {"collective_us": 1259.0, "hidden_us": 507.0, "hidden_fraction": 0.4, "collectives": []}
    rows = [
        {"scaling": "strong", "T": 32768, "ep": 1, "dispatch": "-", "overlap": "-", "fwd_ms": 7.76,
         "fwd_bwd_ms": 27.14, "fwd_bwd_tflops_per_gpu": 364.0},
        {"scaling": "strong", "T": 32768, "ep": 2, "dispatch": "all_gather", "overlap": "none", "fwd_ms": 5.34,
         "fwd_bwd_ms": 16.54, "fwd_bwd_tflops_per_gpu": 299.0, "shared_in_dispatch": True,
         "combine_before_next_down": [], "link_gb_per_gpu": 1.07,
         "forward_trace": {"/device:GPU:0": trace, "/device:GPU:1": dict(trace, hidden_us=509.0)}},
        {"scaling": "strong", "T": 32768, "ep": 2, "dispatch": "ragged_all_to_all", "overlap": "none",
         "error": "JaxRuntimeError: launch failed"},
    ]
    checks = [{"ep": 2, "dispatch": "all_gather", "overlap": "none", "routing": "topk", "skew": True,
               "backend": "mosaic", "check_vma": False, "y_rel_err": 7.7e-4, "dx_rel_err": 3.6e-3,
               "dparams_rel_err": {"w_down": 4.7e-3}, "ok": True}]
    text = report(rows, checks, args, "2 x NVIDIA H200", {2: 284.7})
    lines = text.splitlines()
    assert lines[0] == "# EP layer benchmark: 2 x NVIDIA H200, backend=mosaic, routing=topk"
    assert "EP=2 285 GB/s per GPU" in lines[2]
    table = [line for line in lines if line.startswith("| strong")]
    assert table[0].startswith("| strong | 32768 | 1 | - | - | 7.76 | 27.14 | 364 |")
    assert "| 1259 (40%) | 1.07 | 3.76 |" in table[1]  # mean of the GPUs' hidden time; 1.07 GB / 285 GB/s
    assert "error | JaxRuntimeError: launch failed" in table[2]
    assert lines[-1] == ("- EP=2 all_gather overlap=none topk skewed backend=mosaic: y 7.7e-04, dx 3.6e-03, "
                         "worst dparam 4.7e-03 -> ok")
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_collective_overlap_reports_per_call_time_and_the_middle_calls_timeline(monkeypatch):
    """`benchmarks/ep.py`'s `collective_overlap` on two traced calls of a hand-made trace:
    per-call collective and hidden time, the second call's collectives, and its timeline
    (every event from its first collective's start to its last one's end)."""
    import benchmarks.ep as ep

    def one_call(t0):
        return [(t0, t0 + 1000, "ncclDevKernel_AllGather(args)"), (t0 + 200, t0 + 700, "moe_up_proj"),
                (t0 + 1000, t0 + 3000, "moe_down_proj"), (t0 + 2000, t0 + 4000, "ncclDevKernel_ReduceScatter")]

    events = sorted(one_call(0) + one_call(10_000))
    monkeypatch.setattr(ep, "traced_gpu_events_by_device", lambda fn, *a, steps: {"/device:GPU:0": events})
    report = ep.collective_overlap(None, steps=2)["/device:GPU:0"]
    assert report["collective_us"] == 3.0 and report["hidden_us"] == 1.5  # 0.5 + 1.0 us per call
    assert report["hidden_fraction"] == 0.5
    assert report["collectives"] == [("ncclDevKernel_AllGather", 1.0, 0.5), ("ncclDevKernel_ReduceScatter", 2.0, 1.0)]
    assert [name for _, _, name in report["timeline"]] == [
        "ncclDevKernel_AllGather", "moe_up_proj", "moe_down_proj", "ncclDevKernel_ReduceScatter"]
    assert report["timeline"][2] == (1.0, 2.0, "moe_down_proj")


def test_importing_the_programs_that_set_xla_flags_does_not_start_jax():
    """benchmarks/ep.py and train.main add XLA flags after their imports (the ragged
    collective's decomposer); XLA reads XLA_FLAGS once, when JAX starts its backends. In
    session 35 a module-level device query in benchmarks/forward.py (imported through
    benchmarks/step.py) started them first, and ep.py's ragged runs got XLA's slow default
    collective (400 ms instead of ~5 ms per forward on two H200s). A fresh interpreter
    imports each program and checks that no backend has started."""
    import subprocess
    import sys

    code = (
        "import importlib, jax\n"
        "from jax._src import xla_bridge\n"
        "for m in ('benchmarks.ep', 'train.main'):\n"
        "    importlib.import_module(m)\n"
        "    assert not xla_bridge.backends_are_initialized(), m\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_gpu_turn_past_its_limit_calls_the_watchdog_and_a_quick_one_does_not(tmp_path):
    """ep.py's processes take the GPUs one at a time under a file lock; a turn that hangs
    (a collective whose other rank failed) must not hold the lock forever."""
    import threading
    import time

    from benchmarks.ep import gpu_turn

    fired = threading.Event()
    lock = str(tmp_path / "lock")
    with gpu_turn(lock, limit_s=0.05, on_timeout=lambda limit: fired.set()):
        assert fired.wait(5.0)
    fired.clear()
    with gpu_turn(lock, limit_s=0.5, on_timeout=lambda limit: fired.set()):
        pass
    time.sleep(0.7)
    assert not fired.is_set()


def test_ep_main_saves_its_tables_after_every_row(tmp_path, monkeypatch):
    """A process killed mid-run (a hung collective's --turn-limit, a timeout) keeps the
    tables of the rows it finished: session 35's call 3 lost a process's rows that way."""
    import json

    import pytest

    import benchmarks.ep as ep

    class Killed(BaseException):
        pass

    calls = []

    def fake_bench(shape, ep_size, dispatch, overlap, args, scaling):
        calls.append((scaling, ep_size, dispatch, overlap))
        if len(calls) == 2:
            raise Killed
        return {"scaling": scaling, "T": shape.T, "ep": ep_size, "dispatch": dispatch or "-",
                "overlap": overlap, "fwd_ms": 1.0, "fwd_bwd_ms": 3.0, "fwd_bwd_tflops_per_gpu": 1.0}

    monkeypatch.setattr(ep, "bench", fake_bench)
    monkeypatch.setattr(ep, "link_bandwidth_gbs", lambda ep_size: 100.0)
    out = tmp_path / "ep.md"
    with pytest.raises(Killed):
        ep.main(["--ep", "1", "--skip-check", "--scaling", "strong", "--dispatch", "all_gather",
                 "--backend", "xla", "--out", str(out)])
    saved = json.loads((tmp_path / "ep.json").read_text())
    assert [r["ep"] for r in saved["rows"]] == [1] and len(calls) == 2
    assert "| strong | 32768 | 1 | - | none | 1.00 | 3.00 |" in out.read_text()
