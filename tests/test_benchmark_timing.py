"""The benchmarks' round-robin timing (`benchmarks.forward.interleaved_times_ms`, `sweep`):
paired speed-ups over the first config, the order the calls run in, and that a wrong or
failing config is never timed. A fake clock stands in for CUPTI, so these run on CPU."""

import pytest

from benchmarks.forward import interleaved_times_ms, sweep


def fake_clock(times_by_name, drift):
    """time_ms(f, *args) -> the call's base time times the round's drift factor; records the
    order of the calls."""
    order = []

    def time_ms(f, *args):
        order.append(f.__name__)
        round_ = sum(1 for name in order if name == f.__name__) - 1
        return times_by_name[f.__name__] * drift[round_]

    return time_ms, order


def make(name):
    def f(*args):
        return args
    f.__name__ = name
    return f


def test_interleaved_pairs_out_a_drift_of_the_clock():
    # A drift of 1.3x between rounds: paired ratios stay exact, each call's spread shows it.
    time_ms, order = fake_clock({"a": 2.0, "b": 1.6}, drift=[1.0, 1.3, 1.1])
    (ta, ra, sa), (tb, rb, sb) = interleaved_times_ms([(make("a"), ()), (make("b"), ())], 3,
                                                      time_ms)
    assert order == ["a", "b", "a", "b", "a", "b"]  # round-robin, not one config then the next
    assert ta == pytest.approx(2.2) and tb == pytest.approx(1.76)  # medians over the rounds
    assert ra == pytest.approx(1.0) and rb == pytest.approx(1.25)  # 2.0 / 1.6 in every round
    assert sa == pytest.approx(0.3 / 1.1) and sb == pytest.approx(0.3 / 1.1)


def test_sweep_checks_first_and_never_times_a_wrong_or_failing_config():
    time_ms, order = fake_clock({"good": 3.0, "better": 2.0, "wrong": 1.0},
                                drift=[1.0, 1.0])
    logs = []

    def build(cfg):
        if cfg == "broken":
            raise ValueError("does not fit in SMEM")
        return make(cfg), ()

    def check(f, args):
        return 0.5 if f.__name__ == "wrong" else 1e-3

    (best_t, best_cfg), rows = sweep("up", ["good", "wrong", "broken", "better"], build, check,
                                     flops=6e9, log=logs.append, rounds=2, time_ms=time_ms)
    assert (best_t, best_cfg) == (2.0, "better")
    assert "wrong" not in order and "broken" not in order
    assert [r["config"] for r in rows] == ["wrong", "good", "better"]
    assert rows[0]["err"] == 0.5 and "us" not in rows[0]
    assert rows[2]["speedup_vs_first"] == pytest.approx(1.5)  # over "good", the first timed
    assert any("WRONG" in line for line in logs)
    assert any("failed: ValueError: does not fit" in line for line in logs)
    assert any("x1.500 of the first over 2 rounds" in line for line in logs)


def test_sweep_with_nothing_correct_returns_no_best():
    best, rows = sweep("down", ["wrong"], lambda cfg: (make(cfg), ()), lambda f, a: float("nan"),
                       flops=1.0, log=lambda line: None, time_ms=lambda f, *a: 1.0)
    assert best == (float("inf"), None)
    assert rows[0]["config"] == "wrong"  # a NaN error is not below the tolerance


def test_step_rounds_report_the_paired_bound_ratio(tmp_path, monkeypatch):
    """`benchmarks/step.py --rounds`: the dense bound and every variant that ran are timed
    round-robin, and each row gets `paired_vs_bound`, the bound's time over the step's in the
    same round. The GPU parts (CUPTI, the Mosaic step) are fakes; the plumbing is real."""
    import json

    import jax.numpy as jnp

    import benchmarks.step as step_bench

    shape = (16, 128, 128, 4, 2)
    clock = {"bound": 2.0, "gemms": 1.5, "topk": 4.0, "token_rounding": 5.0}
    # the bound's, the GEMMs' and the two variants' single timings, then two rounds of the
    # bound and the variants
    drift = iter([1.0, 1.0, 1.0, 1.0] + [1.0, 1.0, 1.0] + [1.2, 1.2, 1.2])

    def fake_gpu_time_ms(f, *args, iters=None):
        return clock[f.__name__] * next(drift)

    def fake_step(name):
        def f(*args):
            return jnp.float32(0), (jnp.ones(2),)
        f.__name__ = name
        return f

    bound = fake_step("bound")
    monkeypatch.setitem(step_bench.SHAPES, "fake", shape)
    monkeypatch.setattr(step_bench, "gpu_time_ms", fake_gpu_time_ms)
    monkeypatch.setattr(step_bench, "wall_time_ms", lambda f, *a, iters=None: 1.0)
    monkeypatch.setattr(step_bench, "pipelined_ms", lambda f, *a: 1.0)
    monkeypatch.setattr(step_bench, "kernel_breakdown", lambda f, *a: [])
    monkeypatch.setattr(step_bench, "dense_bound_fns", lambda s: (None, bound, 0, 0))
    monkeypatch.setattr(step_bench, "gemm_bound_fn", lambda s: (fake_step("gemms"), (0, 0, 0, 0)))
    monkeypatch.setattr(step_bench, "step_inputs",
                        lambda s, seed: (0, 0, 0, 0, jnp.zeros(2, jnp.float32)))
    monkeypatch.setattr(step_bench, "make_step",
                        lambda s, routing, backend, config, **kw: fake_step(routing))
    monkeypatch.setattr("sys.argv", ["step.py", "--shapes", "fake", "--rounds", "2", "--out",
                                     str(tmp_path), "--variants",
                                     "topk/cp_async,token_rounding/cp_async"])
    step_bench.main()
    rows = json.loads((tmp_path / "step.json").read_text())
    assert [r["paired_vs_bound"] for r in rows] == pytest.approx([0.5, 0.4])
    assert [r["vs_gemm_bound"] for r in rows] == pytest.approx([1.5 / 4.0, 1.5 / 5.0])
    assert [r["paired_gpu_ms"] for r in rows] == pytest.approx([4.4, 5.5])  # medians of 2 rounds
    assert rows[0]["paired_spread"] == pytest.approx(0.8 / 4.4)
    assert "bound/step, paired" in (tmp_path / "step.md").read_text()


def test_gemm_bound_is_the_layers_flops_and_its_gemms():
    """`benchmarks.layer.gemm_bound_fn`: six batched matmuls of 18 P n d FLOPs in all (XLA's
    cost analysis), whose outputs are the layer's GEMM results on its operands."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.layer import gemm_bound_fn

    shape = (64, 128, 64, 4, 2)  # T, d, n, E, K: 32 rows per expert
    t, d, n, e, k = shape
    f, (xe, a, dy, dh) = gemm_bound_fn(shape)
    w1 = jax.random.normal(jax.random.key(1), (e, d, 2 * n), jnp.bfloat16)
    w2 = jax.random.normal(jax.random.key(2), (e, n, d), jnp.bfloat16)
    cost = f.lower(xe, a, dy, dh, w1, w2).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] == pytest.approx(18 * t * k * n * d, rel=0.01)
    h, y, da, dw2, dx, dw1 = f(xe, a, dy, dh, w1, w2)
    f32 = lambda v: np.asarray(v, np.float32)
    np.testing.assert_allclose(f32(dw1[1]), f32(xe[1]).T @ f32(dh[1]), rtol=2e-2, atol=0.5)
    np.testing.assert_allclose(f32(da[2]), f32(dy[2]) @ f32(w2[2]).T, rtol=2e-2, atol=0.5)
    assert h.shape == (e, 32, 2 * n) and dw2.shape == (e, n, d) and dx.shape == (e, 32, d)


def test_kernels_after_flush_drops_exactly_the_flush():
    """`--flush-l2` (forward.py, backward.py): the flush kernel is found by its fusion name less XLA's
    numeric suffix, wherever it ran; the call's own kernels are all counted; a run without
    the flush or with two matches is an error, not a figure."""
    from benchmarks.forward import kernels_after_flush

    run = [("loop_sine_fusion_3", 60.0), ("moe_dh_mosaic_gpu_kernel(...)", 0.4),
           ("loop_multiply_fusion", 0.01)]
    assert kernels_after_flush(run, "loop_sine_fusion") == pytest.approx(0.41)
    assert kernels_after_flush(run[1:2] + run[:1], "loop_sine_fusion_1") == pytest.approx(0.4)
    with pytest.raises(RuntimeError, match="expected one L2 flush kernel"):
        kernels_after_flush(run[1:], "loop_sine_fusion")
    with pytest.raises(RuntimeError, match="expected one L2 flush kernel"):
        kernels_after_flush(run + [("loop_sine_fusion_4", 60.0)], "loop_sine_fusion")


def test_flushed_call_returns_the_call_and_orders_the_flush_first():
    """The flushed program computes f's outputs unchanged, and in its HLO f's inputs pass
    through the optimization barrier that also carries the flush's result."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.forward import flushed_call

    f = jax.jit(lambda a, b: (a @ b, jnp.sum(a)))
    a = jnp.arange(12.0).reshape(3, 4)
    b = jnp.ones((4, 2))
    buf = jnp.zeros((1024,), jnp.float32)
    flushed, out = flushed_call(f)(buf, a, b)
    for got, want in zip(out, f(a, b)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(flushed, jnp.sin(buf))
    hlo = flushed_call(f).lower(buf, a, b).as_text()
    assert "optimization_barrier" in hlo and "sine" in hlo


def test_gpu_time_ms_with_a_flush_counts_only_the_calls_kernels(monkeypatch):
    """`gpu_time_ms(..., flush_mb=...)` end to end with a fake CUPTI: the flush is timed
    alone once (one kernel), then every timed run's kernels less that one, medianed."""
    import jax.numpy as jnp

    import benchmarks.forward as fw

    class FakeProfiler:
        @staticmethod
        def measure(f, aggregate=True, iterations=1):
            def run(*args):
                out = f(*args)
                if len(args) == 1:  # the flush alone
                    return out, [("loop_sine_fusion", 0.05)]
                runs = [[("loop_sine_fusion_2", 0.05), ("moe_dh", t), ("small", 0.01)]
                        for t in (0.3, 0.5, 0.4)][:iterations]
                return out, runs if iterations > 1 else runs[0]
            return run

    monkeypatch.setattr(fw, "profiler", FakeProfiler)
    fw.flush_buffer.cache_clear()  # measured with the fake profiler, not a cached real one
    f = lambda a, b: a + b  # noqa: E731
    x = jnp.ones((4,))
    assert fw.gpu_time_ms(f, x, x, iters=3, flush_mb=1) == pytest.approx(0.41)
    assert fw.gpu_time_ms(f, x, x, iters=1, flush_mb=1) == pytest.approx(0.31)
    fw.flush_buffer.cache_clear()  # nothing measured by the fake outlives the test


@pytest.mark.parametrize("d, n", [(1536, 256), (4096, 512)])
def test_step_variant_flags_build_configs(d, n):
    """Every `step.py --variants .../flag` builds a KernelConfig from the shape's default
    (a typo in a field name fails here, not on the GPU)."""
    import benchmarks.step as st
    from pallas_moe.kernels.config import KernelConfig

    base = KernelConfig.for_shape(d, n)
    for name, flag in st.CONFIG_FLAGS.items():
        assert isinstance(flag(base, n), KernelConfig), name


def test_decode_benchmark_small_routing_variants_trace_in_their_context(monkeypatch):
    """`benchmarks/decode.py`'s routing suffixes: each call is traced with the small-batch
    routing limit its suffix asks for (`+small` 32 tokens, `+blocks` none, no suffix the
    library's default), checked against the xla backend before it is timed, and reported;
    CUPTI and the megakernel are faked so the plumbing runs on CPU."""
    import jax

    from benchmarks import decode
    from pallas_moe.routing import kernels

    seen = []

    def fake_make_ffn(variant, overrides):
        assert variant in ("static", "static_meta", "static_jnp")  # the suffix is stripped

        def ffn(x, plan, w1, w2):
            seen.append((variant, kernels.small_batch_limit()))  # read while tracing
            return decode.pm.moe_ffn(x, plan, w1, w2, backend="xla")
        return ffn

    monkeypatch.setattr(decode, "make_ffn", fake_make_ffn)
    monkeypatch.setattr(decode, "profile_ms", lambda f, *a, iters: (0.05, 0.03, [("k", 0.05)]))
    monkeypatch.setattr(decode, "wall_time_ms", lambda f, *a, iters: 0.1)
    monkeypatch.setattr(decode, "D", 128)
    monkeypatch.setattr(decode, "N", 64)
    monkeypatch.setattr(decode, "E", 8)
    monkeypatch.setattr(decode, "K", 2)
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = (jax.random.normal(k1, (8, 128, 128)) * 0.1).astype(jax.numpy.bfloat16)
    w2 = (jax.random.normal(k2, (8, 64, 128)) * 0.1).astype(jax.numpy.bfloat16)
    logs = []
    res = decode.run_tokens(3, ["static", "static_meta+small", "static_jnp+blocks"], {}, w1, w2,
                            3000.0, 2, logs.append)
    assert seen == [("static", kernels.SMALL_BATCH_DEFAULT),
                    ("static_meta", kernels.SMALL_BATCH_TOKENS), ("static_jnp", 0)]
    assert kernels.small_batch_limit() == kernels.SMALL_BATCH_DEFAULT  # restored
    assert res["static_err"] < 1e-2 and res["static_meta+small_us"] == pytest.approx(50.0)
    assert res["static_jnp+blocks_err"] < 1e-2
    assert "routing_small_us" in res
    assert any("plan bitwise the default's: True" in line for line in logs)


def test_decode_benchmark_kernels_meta_runs_the_schedule_kernel(monkeypatch):
    """`benchmarks/decode.py`'s `kernels_meta`: the kernel path with its tile metadata from
    `moe_forward_schedules` (`ForwardConfig.schedule_impl="kernel"`), `kernels` without it;
    that kernel counts as metadata, not as an MoE kernel, in "MoE kernels alone"."""
    import jax
    import jax.numpy as jnp

    from benchmarks import decode
    from pallas_moe.routing import topk_plan
    from tests.cuda_target import h100_target

    monkeypatch.setattr(decode, "D", 128)
    monkeypatch.setattr(decode, "N", 64)
    sds = jax.ShapeDtypeStruct
    plan = jax.eval_shape(lambda l: topk_plan(l, 2), sds((8, 8), jnp.float32))
    args = (sds((8, 128), jnp.bfloat16), plan, sds((8, 128, 128), jnp.bfloat16),
            sds((8, 64, 128), jnp.bfloat16))
    for variant, kernel in (("kernels", False), ("kernels_meta", True)):
        with h100_target():
            text = str(jax.make_jaxpr(decode.make_ffn(variant, {}))(*args))
        assert ("moe_forward_schedules" in text) == kernel and "moe_up_proj" in text, variant
    assert "moe_forward_schedules" in decode.META_KERNELS
    assert not any(k in "moe_forward_schedules" for k in decode.MOE_KERNELS)
    # `kernels_agg4`: the aggregation keeps its configured tokens per CTA at every T.
    import importlib

    moe_forward = importlib.import_module("pallas_moe.kernels.moe_forward")  # the module
    seen = []
    real_aggregate = moe_forward.aggregate
    monkeypatch.setattr(moe_forward, "aggregate", lambda *a, config, **kw: (
        seen.append((config.resident_ctas, config.rows_in_flight)),
        real_aggregate(*a, config=config, **kw))[1])
    for variant in ("kernels", "kernels_agg4"):
        with h100_target():
            jax.make_jaxpr(decode.make_ffn(variant, {}))(*args)
    assert seen[0][0] > 0 and seen[0][1] > 1 and seen[1] == (0, 1), seen

def test_bias_grads_benchmark_checks_both_versions_on_the_cpu(tmp_path):
    """`benchmarks/bias_grads.py --smoke`: the dense-product bias gradients and the previous
    scan agree and repeat bitwise at its tiny shape (the GPU run times them)."""
    import benchmarks.bias_grads as bg

    lines = []
    result = bg.run_shape("smoke", bg.SMOKE_SHAPE, 1, True, lines.append)
    assert result["err"] < 1e-5 and result["bitwise"], result
    assert result["old_us"] > 0 and result["new_us"] > 0


def test_step_scan_bias_flag_traces_the_previous_bias_gradients():
    """`step.py --variants .../scan-bias` runs the step with the kernel backward's
    expert-bias gradients swapped for the previous scan while it runs (its trace), and puts
    today's back after."""
    import importlib

    import benchmarks.step as st
    from benchmarks.bias_grads import scan_bias_gradients

    mb = importlib.import_module("pallas_moe.kernels.moe_backward")

    today = mb.expert_bias_gradients
    wrapped = st.CODE_FLAGS["scan-bias"](lambda: mb.expert_bias_gradients)
    assert wrapped() is scan_bias_gradients
    assert mb.expert_bias_gradients is today and today is not scan_bias_gradients



@pytest.mark.slow
def test_step_scan_bias_flag_reaches_the_traced_backward(monkeypatch):
    """The `scan-bias` step really traces the scan, also after the default step traced the
    same cached layer (`_kernel_moe_ffn` is one function per config): interpret mode, a
    tiny gpt-oss-like layer (expert biases, clamped SwiGLU), gradients close to the
    default's."""
    import jax.numpy as jnp

    import benchmarks.bias_grads as bg
    import benchmarks.step as st

    calls = []
    scan = bg.scan_bias_gradients

    def spy(*args, **kwargs):
        calls.append(1)
        return scan(*args, **kwargs)

    monkeypatch.setattr(bg, "scan_bias_gradients", spy)
    shape = (64, 128, 64, 4, 2)
    x, router, w1, w2, cot = st.step_inputs(shape, 0)
    inputs = (x, router, w1, w2, cot.astype(jnp.bfloat16), *st.step_bias_inputs(shape, 0))
    make = lambda: st.make_step(shape, "topk", "interpret", None, gpt_oss=True)  # noqa: E731
    _, grads = make()(*inputs)
    assert not calls
    _, scan_grads = st.CODE_FLAGS["scan-bias"](make())(*inputs)
    assert calls, "the scan-bias step did not trace the scan"
    for g, r in zip(scan_grads, grads):
        assert st.rel_err(g, r) < 1e-2


class FakeNVML:
    """Stands in for `pynvml`: each read returns the next of `samples` (SM MHz, mW, C, bits),
    repeating the last; `fail_after` reads, the clock read raises."""

    def __init__(self, samples, fail_after=None):
        self.samples, self.reads, self.fail_after = samples, 0, fail_after

    def nvmlDeviceGetHandleByIndex(self, index):
        if index != 0:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return "card0"

    def _now(self):
        return self.samples[min(self.reads, len(self.samples) - 1)]

    def nvmlDeviceGetClockInfo(self, handle, clock_type):
        assert handle == "card0" and clock_type == 1  # NVML_CLOCK_SM
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return self._now()[0]

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._now()[1]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        return self._now()[2]

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        bits = self._now()[3]
        self.reads += 1
        return bits


def test_clock_log_summarizes_what_each_timed_call_ran_at():
    """`interleaved_times_ms(..., clocks=)` samples the card under each call's index while it
    is timed; the summary gives the median and lowest SM clock, the power, the hottest
    reading and the share of samples each slowdown reason was set in (idle and
    application-clock bits are not slowdowns)."""
    from benchmarks.gpu_clocks import ClockLog

    nvml = FakeNVML([(1980, 500_000, 60, 0x1), (1755, 700_000, 71, 0x4),
                     (1755, 699_000, 72, 0x4 | 0x20), (1830, 650_000, 70, 0x2)])
    log = ClockLog(period_s=1e-4, nvml=nvml)
    assert log.available

    def time_ms(f, *args):  # the timed call lasts until the sampler read 4 times
        while nvml.reads < 4:
            pass
        return 1.0

    interleaved_times_ms([(make("a"), ())], 1, time_ms, clocks=log)
    s = log.summary(0)
    assert s["samples"] >= 4 and s["errors"] == []
    assert s["sm_mhz_min"] == 1755 and s["temp_c_max"] == 72 and s["power_w_max"] == 700.0
    assert set(s["slowdown"]) == {"power cap", "thermal (software)"}
    assert 0 < s["slowdown"]["thermal (software)"] < s["slowdown"]["power cap"] < 1
    text = log.describe(0)
    assert "min 1755" in text and "slowed by power cap" in text and "thermal (software)" in text
    assert log.summary(1) is None and log.describe(1) == ""  # nothing sampled under key 1


def test_clock_log_never_stops_the_timing(monkeypatch):
    """Without NVML (no module, or no such card) nothing is sampled and the timing is
    unchanged; a read that fails mid-call ends that call's sampling with the error
    recorded, and the call's time stands."""
    import sys

    from benchmarks import gpu_clocks
    from benchmarks.gpu_clocks import ClockLog

    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    no_module = ClockLog()
    assert not no_module.available and "could not be loaded" in no_module.unavailable_reason
    assert gpu_clocks._load_nvml() is None
    no_card = ClockLog(nvml=FakeNVML([(1980, 1, 1, 0)]), device_index=3)
    assert not no_card.available and "no device 3" in no_card.unavailable_reason
    for log in (no_module, no_card):
        time_ms, order = fake_clock({"a": 2.0, "b": 1.0}, drift=[1.0])
        (ta, _, _), (tb, rb, _) = interleaved_times_ms([(make("a"), ()), (make("b"), ())], 1,
                                                       time_ms, clocks=log)
        assert (ta, tb, rb) == (2.0, 1.0, 2.0) and order == ["a", "b"]
        assert log.summary(0) is None and log.describe(0) == ""

    failing = ClockLog(period_s=1e-4, nvml=FakeNVML([(1980, 1000, 50, 0)], fail_after=2))
    with failing.sampling("k"):
        while not failing._samples["k"]["errors"]:
            pass
    s = failing.summary("k")
    assert s["samples"] == 2 and "GPU_IS_LOST" in s["errors"][0]
    with pytest.raises(ValueError, match="period_s=0 must be > 0"):
        ClockLog(period_s=0, nvml=FakeNVML([(1980, 1, 1, 0)]))
