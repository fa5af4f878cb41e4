"""Session 11, second A/B: why the epilogue-warpgroup up-proj (bn=128 per consumer) ran 4x
slower than the warp-specialized kernel while its bn=64 variant did not. Hypothesis: the
consumers' two 64x128 fp32 accumulators (128 registers) do not fit in what ptxas gives the
consumer code of a 4-warpgroup kernel (128 per thread at launch), so the wgmmas are
serialized. For each variant: ptxas's report (MOSAIC_GPU_DUMP_PTXAS, summarized), a bitwise
check against the warp-specialized kernel with poisoned outputs, and CUPTI GPU time.

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/dump PYTHONPATH=. \
      python3 benchmarks/history/session11/epilogue_regs.py --out $OUT --dump /tmp/dump

Needs `epilogue_wg_experiment.patch` applied (main dropped the kernel and the A/B switch).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shutil
import sys

import numpy as np

import jax

sys.path.insert(0, os.getcwd())
from benchmarks.logs import open_log  # noqa: E402
from benchmarks.forward import SHAPES, dense_bound_ms, gpu_time_ms, make_case, poison_then  # noqa: E402
from pallas_moe.kernels import _common  # noqa: E402
import importlib  # noqa: E402
up_mod = importlib.import_module("pallas_moe.kernels.up_proj")
from pallas_moe.kernels.moe_forward import ForwardConfig  # noqa: E402


def variants(d, n):
    base = ForwardConfig.for_shape(d, n).up
    epi = dataclasses.replace(base, epilogue_warpgroup=True)
    v = [
        ("ws", base, True, None),
        ("epi regs-in-branches 40/168/136", epi, True, None),
        ("epi regs-at-top 40/168/136", epi, False, None),
        ("epi regs-in-branches 32/176/128", epi, True, (32, 176, 128)),
        ("epi regs-in-branches 24/184/120", epi, True, (24, 184, 120)),
        ("epi bn64 5st", dataclasses.replace(epi, block_n=64, num_stages=5), True, None),
        ("epi bn64 4st", dataclasses.replace(epi, block_n=64, num_stages=4), True, None),
    ]
    if SET == "buffer":  # run 5: H staged in SMEM of its own, 2 pipeline stages
        buf = dataclasses.replace(epi, epilogue_staging="buffer", num_stages=2)
        v = [
            ("ws", base, True, None),
            ("ws 2st tma-gather", dataclasses.replace(base, num_stages=2, gather="tma"), True, None),
            ("epi slot 24/184/120", epi, True, (24, 184, 120)),
            ("epi buffer 2st", buf, True, None),
            ("epi buffer 2st 24/184/120", buf, True, (24, 184, 120)),
            ("epi buffer 2st gate-only act", buf, True, "gate-only"),
        ]
    return v


SET = "regs"


from pallas_moe.ops.activation import SwiGLU  # noqa: E402


class _GateOnly(SwiGLU):
    """Ablation only: A = the gate pre-activation (no exp, no product)."""

    def apply(self, gate, up):
        return gate


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dump", default="")
    p.add_argument("--shapes", default="7b,30b")
    p.add_argument("--set", default="regs", choices=("regs", "buffer"))
    args = p.parse_args()
    global SET
    SET = args.set
    log = open_log(args.out, "epilogue_regs_log.txt")

    def ptxas_summary(tag):
        if not args.dump or not os.path.isdir(args.dump):
            return
        files = sorted(glob.glob(os.path.join(args.dump, "**", "*"), recursive=True))
        keep = os.path.join(args.dump + "_kept", re.sub(r"[^A-Za-z0-9_.-]", "_", tag))
        os.makedirs(keep, exist_ok=True)
        for f in files:
            if not os.path.isfile(f):
                continue
            if "ptxas" in os.path.basename(f).lower() or f.endswith((".log", ".txt")):
                with open(f, errors="replace") as fh:
                    for line in fh:
                        if re.search(r"registers|spill|serializ|Potential|smem|stack", line, re.I):
                            log(f"    ptxas[{tag}] {line.rstrip()[:300]}")
            shutil.move(f, os.path.join(keep, os.path.basename(f)))

    ptxas_summary("startup")
    rows_out = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        T, d, n, E, K = shape
        x, w1, w2, plan = make_case(shape, False, seed=hash((name, False)) % 1000)
        P, rows = plan.capacity, int(plan.num_rows)
        bound = dense_bound_ms(shape)[0] * 1e3
        ref = None
        for tag, cfg, in_branches, regs in variants(d, n):
            if SET == "regs" and name != "7b" and tag not in (
                    "ws", "epi regs-in-branches 40/168/136", "epi regs-in-branches 32/176/128",
                    "epi bn64 5st"):
                continue
            up_mod._common.REGISTERS_IN_ROLE_BRANCHES = in_branches
            act = {}
            if regs == "gate-only":  # ablation: A = H's gate half (timing only)
                act, regs = dict(activation=_GateOnly()), None
            up_mod._REGISTERS_OVERRIDE = regs
            meta = jax.jit(lambda g, t, bm=cfg.block_m: _common.tile_meta(g, t, bm))(
                plan.group_sizes, plan.token_ids)
            f = jax.jit(lambda x, t, g, w, m, cfg=cfg, act=act: up_mod.up_proj(x, t, g, w, config=cfg, meta=m, **act))
            try:
                h, a = poison_then(f, x, plan.token_ids, plan.group_sizes, w1, meta, nbytes=P * 3 * n * 2)
                ptxas_summary(f"{name} {tag}")
                if act:
                    same = None
                elif ref is None:
                    ref = (np.asarray(h[:rows]), np.asarray(a[:rows]))
                    same = True
                else:
                    same = bool(np.array_equal(ref[0], np.asarray(h[:rows])) and
                                np.array_equal(ref[1], np.asarray(a[:rows])))
                t = gpu_time_ms(f, x, plan.token_ids, plan.group_sizes, w1, meta) * 1e3
            except Exception as e:  # noqa: BLE001
                log(f"  {name} {tag}: FAILED {type(e).__name__}: {str(e)[:400]}")
                continue
            log(f"  {name} {tag}: {t:.1f} us, bitwise={same}")
            rows_out.append((name, tag, t, same, bound))
    up_mod._common.REGISTERS_IN_ROLE_BRANCHES = True
    up_mod._REGISTERS_OVERRIDE = None
    log("\n| shape | variant | us | vs ws | of dense bound | bitwise ws |")
    log("|---|---|---|---|---|---|")
    ws = {r[0]: r[2] for r in rows_out if r[1] == "ws"}
    for name, tag, t, same, bound in rows_out:
        log(f"| {name} | {tag} | {t:.1f} | {t / ws.get(name, float('nan')):.3f} | {bound / t:.3f} | {same} |")


if __name__ == "__main__":
    main()
