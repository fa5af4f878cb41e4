"""Session 26: why is the 7B step's pipelined time above its GPU kernel time?

Call 1: GPU kernel time 3.25-3.27 ms, pipelined (10 steps back to back) 3.60-3.64 ms/step,
yet a trace of 5 back-to-back steps shows only 13 us/step of idle between kernels (span 3.29
ms/step). Hypothesis: clocks fall under sustained load (the pipelined figure runs 50 steps,
~180 ms, in a row; the CUPTI figure times single steps with syncs in between). This prints,
for N back-to-back steps (N = 5, 20, 60), the per-step span in a profiler trace (time between
consecutive up-proj launches) and the busy time, the wall ms/step without a trace, and
nvidia-smi's SM clock and power sampled every 10 ms during each phase.

    PYTHONPATH=. python3 benchmarks/history/session26/sustained.py
"""
import statistics
import subprocess
import threading
import time

import jax

from benchmarks.forward import SHAPES
from benchmarks.step import make_step, step_inputs, traced_gpu_events
from pallas_moe.kernels import KernelConfig

SAMPLES = []


def sampler(stop):
    proc = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
         "-lms", "10"], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if stop.is_set():
            break
        try:
            clk, pw, tmp = (float(v) for v in line.split(","))
        except ValueError:
            continue
        SAMPLES.append((time.perf_counter(), clk, pw, tmp))
    proc.kill()


def window(t0, t1):
    s = [x for x in SAMPLES if t0 <= x[0] <= t1]
    if not s:
        return "no samples"
    clk = [x[1] for x in s]
    pw = [x[2] for x in s]
    return (f"SM MHz min/med/max {min(clk):.0f}/{statistics.median(clk):.0f}/{max(clk):.0f}, "
            f"W med/max {statistics.median(pw):.0f}/{max(pw):.0f}, temp {s[-1][3]:.0f} C, {len(s)} samples")


def main():
    shape = SHAPES["7b"]
    _, d, n, _, _ = shape
    step = make_step(shape, "topk", "mosaic", KernelConfig.for_shape(d, n, gather="cp_async"))
    x, router, w1, w2, cot = step_inputs(shape, 0)
    args = (x, router, w1, w2, cot.astype(jax.numpy.bfloat16))
    jax.block_until_ready(step(*args))
    stop = threading.Event()
    threading.Thread(target=sampler, args=(stop,), daemon=True).start()
    time.sleep(1.0)
    print(f"idle: {window(time.perf_counter() - 0.9, time.perf_counter())}")
    rows = []
    for n_steps in (5, 20, 60):
        time.sleep(1.0)  # let the clocks recover
        t0 = time.perf_counter()
        outs = [step(*args) for _ in range(n_steps)]
        jax.block_until_ready(outs)
        t1 = time.perf_counter()
        del outs
        wall = 1e3 * (t1 - t0) / n_steps
        clocks = window(t0, t1)
        time.sleep(1.0)
        events = traced_gpu_events(step, *args, steps=n_steps)
        starts = [s for s, _, name in events if name.startswith("moe_up_proj")]
        spans = [(b - a) / 1e6 for a, b in zip(starts, starts[1:])]
        busy = sum(e - s for s, e, _ in events) / 1e6 / n_steps
        print(f"N={n_steps}: wall {wall:.3f} ms/step ({clocks}); traced span per step "
              f"first/median/last {spans[0]:.3f}/{statistics.median(spans):.3f}/{spans[-1]:.3f}, "
              f"kernel time {busy:.3f} ms/step")
        print("   traced spans: " + " ".join(f"{s:.2f}" for s in spans))
        rows.append((n_steps, wall, statistics.median(spans), busy))
    stop.set()
    print("| back-to-back steps | wall ms/step | traced span ms/step (median) | kernel ms/step |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.3f} | {r[2]:.3f} | {r[3]:.3f} |")


if __name__ == "__main__":
    main()
