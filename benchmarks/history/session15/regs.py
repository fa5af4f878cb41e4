"""Session 15: register use and spills of the kernels (issues 9, 16), from ptxas.

    PYTHONPATH=. python3 benchmarks/history/session15/regs.py OUT_DIR [variant,...]

Each variant compiles in its own process with MOSAIC_GPU_DUMP_PTXAS / _SASS and
MOSAIC_GPU_DUMP_TO set, runs once, and is timed (CUPTI, median). Variants: the default 7B
layer step (every kernel of the library's training step), and session 14's ping-pong dH
(`dh_pp.py`: dh.py as of 3891ad3 with the ablation switches) at 7B, whole and ablated.
Prints, per kernel: registers, spill bytes, and the SASS's local loads / stores (LDL/STL).

`dh_pp.py` (session 14's dH module with the ping-pong kernel and this session's ablation
switches) is not kept in the tree; recreate it before running:

    git show 3891ad3:pallas_moe/kernels/dh.py > benchmarks/history/session15/dh_pp.py
    patch -p0 benchmarks/history/session15/dh_pp.py < benchmarks/history/session15/dh_pp.patch
"""
import glob
import json
import os
import re
import subprocess
import sys
import tarfile

VARIANTS = {
    "step7b": {},
    "pp": dict(pingpong=True, num_stages=4),
    "pp_nomath": dict(pingpong=True, num_stages=4, ablate=["nomath"]),
    "pp_noepi": dict(pingpong=True, num_stages=4, ablate=["noepi"]),
    "pp_ep16": dict(pingpong=True, num_stages=4, epilogue_cols=16),
    "pp_norebalance": dict(pingpong=True, num_stages=4, rebalance_registers=False),
    "pp_ep16_obar": dict(pingpong=True, num_stages=4, epilogue_cols=16, ablate=["obar"]),
    "pp_obar": dict(pingpong=True, num_stages=4, ablate=["obar"]),
    "pp_ep16_r240": dict(pingpong=True, num_stages=4, epilogue_cols=16, producer_regs=24),
    "pp_mfence": dict(pingpong=True, num_stages=4, ablate=["mfence"]),
    "pp_ep16_mfence": dict(pingpong=True, num_stages=4, epilogue_cols=16, ablate=["mfence"]),
    "coop": dict(),
    "coop_mfence": dict(ablate=["mfence"]),
    "coop_ep32_mfence": dict(epilogue_cols=32, ablate=["mfence"]),
}
# Variants whose SASS and ptxas log come back (`sass.tar.gz`).
KEEP_SASS = ("pp_ep16_mfence", "coop_mfence")


def worker(name):
    import dataclasses

    import numpy as np

    import jax
    import jax.numpy as jnp

    from benchmarks.forward import gpu_time_ms

    spec = dict(VARIANTS[name])
    if name == "step7b":
        from benchmarks.step import make_step, step_inputs
        from pallas_moe.kernels import KernelConfig  # noqa: F401  (import check)

        shape = (24576, 1536, 256, 128, 8)
        f = make_step(shape, "topk", "mosaic", None)
        args = step_inputs(shape, 15)
        print(json.dumps(dict(variant=name, us=gpu_time_ms(f, *args) * 1e3)), flush=True)
        return
    sys.path.insert(0, os.path.dirname(__file__))
    import dh_pp

    from pallas_moe.kernels import _common
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.routing import topk_plan

    T, d, n, E, K = 24576, 1536, 256, 128, 8
    ks = jax.random.split(jax.random.key(15), 5)
    plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E)))
    P = plan.capacity
    go = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
    h = (2 * jax.random.normal(ks[2], (P, 2 * n), jnp.float32)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (E, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
    base = BackwardConfig.for_shape(d, n).dh
    cfg = dh_pp.DHConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                            if f.name in {g.name for g in dataclasses.fields(dh_pp.DHConfig)}})
    cfg = dataclasses.replace(cfg, persistent_ctas=jax.devices()[0].core_count, early_h=False,
                              gather_completion="wait_group")
    dh_pp._ABLATE.update(spec.pop("ablate", []))
    if "producer_regs" in spec:
        _common.PRODUCER_REGISTERS = spec.pop("producer_regs")
    cfg = dataclasses.replace(cfg, **spec)
    meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.block_m))(plan.group_sizes,
                                                                      plan.token_ids)
    f = jax.jit(lambda *a: dh_pp.dh_kernel(*a, config=cfg, meta=meta))
    args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
    print(json.dumps(dict(variant=name, config=str(cfg), us=gpu_time_ms(f, *args) * 1e3)),
          flush=True)


def summarize(dump_dir):
    """{kernel file stem: dict(regs, spill_st, spill_ld, ldl, stl)} from a dump folder."""
    rows = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "**", "*"), recursive=True)):
        if not os.path.isfile(path):
            continue
        text = open(path, errors="replace").read()
        stem = os.path.basename(path)
        for m in re.finditer(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, "
                             r"(\d+) bytes spill stores, (\d+) bytes spill loads", text):
            rows.setdefault(m.group(1), {}).update(
                stack=int(m.group(2)), spill_st=int(m.group(3)), spill_ld=int(m.group(4)))
        for m in re.finditer(r"Compiling entry function '(\S+)'[\s\S]*?Used (\d+) registers",
                             text):
            rows.setdefault(m.group(1), {}).update(regs=int(m.group(2)))
        if "sass" in stem.lower() or re.search(r"\b(LDL|STL)\b", text):
            r = rows.setdefault(stem, {})
            r.update(ldl=len(re.findall(r"\bLDL\b", text)), stl=len(re.findall(r"\bSTL\b", text)),
                     setmaxnreg=len(re.findall(r"SETMAXNREG|USETMAXREG", text)))
    return rows


def main(out, names):
    os.makedirs(out, exist_ok=True)
    here = os.path.abspath(__file__)
    report = []
    for name in names:
        dump = f"/tmp/regs_dump/{name}"
        os.makedirs(dump, exist_ok=True)
        env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1",
                   MOSAIC_GPU_DUMP_TO=dump)
        proc = subprocess.run([sys.executable, here, "--worker", name], env=env,
                              capture_output=True, text=True, timeout=240)
        with open(os.path.join(dump, "worker_stdout.txt"), "w") as fh:
            fh.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        timing = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        print(name, "rc", proc.returncode, timing[-1] if timing else proc.stderr[-2000:],
              flush=True)
        rows = summarize(dump)
        for kernel, r in rows.items():
            print("   ", kernel, r, flush=True)
        report.append(dict(variant=name, rc=proc.returncode, timing=timing, kernels=rows))
    with open(os.path.join(out, "regs.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    with tarfile.open(os.path.join(out, "sass.tar.gz"), "w:gz") as tar:
        for name in KEEP_SASS:
            for path in sorted(glob.glob(f"/tmp/regs_dump/{name}/**/*", recursive=True)):
                base = os.path.basename(path).lower()
                if os.path.isfile(path) and "mlir" not in base and "moe_dh" in base:
                    print("   kept", path, os.path.getsize(path), flush=True)
                    tar.add(path, arcname=os.path.relpath(path, "/tmp/regs_dump"))
    print("all files:", sorted(os.path.relpath(p, "/tmp/regs_dump") for p in
                              glob.glob("/tmp/regs_dump/*/**", recursive=True))[:60])


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS))
