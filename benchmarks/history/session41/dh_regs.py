"""Session 41: registers and spills of today's dH kernels at 7B, from ptxas (issue 9).

    PYTHONPATH=. python3 benchmarks/history/session41/dh_regs.py OUT_DIR [variant,...]

The ping-pong dH (`DHConfig.pingpong`, session 39) runs a dSwiGLU epilogue beside two live
[64, 128] f32 accumulators; session 14's ping-pong dH spilled there. Each variant compiles
in its own process with MOSAIC_GPU_DUMP_PTXAS / _SASS and MOSAIC_GPU_DUMP_TO set, runs once
on fresh data and is timed (CUPTI median), and the ptxas log and SASS are read as session
15's `regs.py` reads them (`summarize`): registers, spill bytes, local loads and stores.
Variants: "coop" (the persistent default), "pp" (ping-pong, 4 stages, as `backward.py
--sweep pingpong_dH` times it) and "pp_mbarrier" (its other cp.async completion).
"""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

VARIANTS = {
    "coop": {},
    "pp": dict(pingpong=True, num_stages=4),
    "pp_mbarrier": dict(pingpong=True, num_stages=4, gather_completion="mbarrier"),
}


def _session15_summarize():
    """`summarize(dump_dir)` of session 15's regs.py (ptxas log and SASS -> per kernel)."""
    path = os.path.join(os.path.dirname(__file__), "..", "session15", "regs.py")
    spec = importlib.util.spec_from_file_location("session15_regs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.summarize


def worker(name):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.forward import gpu_time_ms
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.dh import dh_kernel
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.routing import topk_plan

    T, d, n, E, K = 24576, 1536, 256, 128, 8
    ks = jax.random.split(jax.random.key(41), 5)
    plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E)))
    P = plan.capacity
    go = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
    h = (2 * jax.random.normal(ks[2], (P, 2 * n), jnp.float32)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
    cfg = dataclasses.replace(BackwardConfig.for_shape(d, n).dh, **VARIANTS[name])
    meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.block_m))(plan.group_sizes,
                                                                      plan.token_ids)
    f = jax.jit(lambda *a: dh_kernel(*a, config=cfg, meta=meta))
    args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    print(json.dumps(dict(variant=name, config=str(cfg), us=gpu_time_ms(f, *args) * 1e3)),
          flush=True)


def main(out, names):
    os.makedirs(out, exist_ok=True)
    summarize = _session15_summarize()
    here = os.path.abspath(__file__)
    report = []
    for name in names:
        dump = os.path.join(out, "dump", name)
        os.makedirs(dump, exist_ok=True)
        env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1",
                   MOSAIC_GPU_DUMP_TO=dump)
        proc = subprocess.run([sys.executable, here, "--worker", name], env=env,
                              capture_output=True, text=True, timeout=240)
        with open(os.path.join(dump, "worker_stdout.txt"), "w") as fh:
            fh.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        timing = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        print(name, "rc", proc.returncode, timing[-1] if timing else proc.stderr[-2000:],
              flush=True)
        rows = summarize(dump)
        for kernel, row in rows.items():
            print("   ", kernel, row, flush=True)
        report.append(dict(variant=name, rc=proc.returncode, timing=timing, kernels=rows))
    with open(os.path.join(out, "regs.json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS))
