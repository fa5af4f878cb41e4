"""How fast one CTA per SM streams a weight matrix from HBM through a TMA ring (issue 15).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/stream_probe.py --out $OUT \
        [--mbytes 75] [--boxes 64x64,64x128,64x256,128x128] [--stages 2,3,4,5,6,8]

At T = 1 the decode megakernel streams the 8 routed experts' weights (75 MB at the Qwen3-30B
widths) at 13-18 GB/s per SM, ~1.7 TB/s in all, against the ~3.4 TB/s of a device copy
(`docs/decode.md`, "Where T = 1 loses"): is that the rate a ring of its size reaches, or
something of the megakernel's own? This probe is the ring alone: `plgpu.emit_pipeline` over
`[bk, bn]` bf16 boxes (128-byte swizzled, the layout wgmma reads), `stages` boxes in flight
(`max_concurrent_steps`), one CTA per SM each taking a contiguous run of boxes, and a body
that reads nothing (the time is the loads and the ring's barrier waits). It prints the rate
per SM and in all for every (box, stages) pair, against a device copy of the same bytes
measured in the same run. The decode megakernel's up task streams a [64, 64] gate and a
[64, 64] up box per K step (16 KB), 5 stages by default.

Interpret mode (`--interpret`, a small matrix) checks that the kernel runs; its times mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.forward import gpu_time_ms, wall_time_ms  # noqa: E402
from benchmarks.logs import open_log  # noqa: E402
from pallas_moe.kernels import _common  # noqa: E402
from pallas_moe.kernels.moe_forward import default_num_sms  # noqa: E402


def stream(w: jax.Array, *, box: tuple[int, int], stages: int, num_ctas: int,
           interpret: bool = False) -> jax.Array:
    """Streams bf16 `w` [R, C] through SMEM: CTA i loads boxes `[i * per, (i + 1) * per)` of
    the row-major box grid (per = boxes / num_ctas), `stages` in flight. Returns an unused
    [num_ctas] i32 (a kernel needs an output)."""
    rows, cols = w.shape
    bk, bn = box
    if bk > 128 or 128 % bk:
        raise ValueError(f"box rows {bk} must divide 128.")
    _common.require_multiple("w.shape[0]", rows, bk, f"whole boxes of {bk} rows")
    _common.require_multiple("w.shape[1]", cols, bn, f"whole boxes of {bn} columns")
    col_boxes = cols // bn
    boxes = rows // bk * col_boxes
    _common.require_multiple("boxes", boxes, num_ctas, f"{num_ctas} CTAs take equal runs")
    per = boxes // num_ctas

    def body(w_ref, out_ref):
        del out_ref  # never written: the probe times the loads
        first = jax.lax.axis_index("cta") * per

        def step(_, w_smem):  # the box landed; release it
            del w_smem

        def box_of(i):
            b = first + i
            return b // col_boxes, b % col_boxes

        plgpu.emit_pipeline(
            step, grid=(per,),
            in_specs=[plgpu.BlockSpec((bk, bn), box_of,
                                      transforms=_common.mma_transforms(w.dtype))],
            max_concurrent_steps=stages,
        )(w_ref)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_ctas,), jnp.int32),
        grid=(num_ctas,),
        grid_names=("cta",),
        kernel_name="stream_probe",
        interpret=_common.interpret_params(interpret),
    )(w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--mbytes", type=float, default=75.5,
                    help="matrix size (the 8 experts' weights at T = 1: 75.5 MB)")
    ap.add_argument("--boxes", default="64x64,64x128,64x256,128x128")
    ap.add_argument("--stages", default="2,3,4,5,6,8")
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    log = open_log(args.out, "stream_probe_log.txt")
    num_ctas = 4 if args.interpret else default_num_sms()
    boxes = [tuple(int(v) for v in b.split("x")) for b in args.boxes.split(",")]
    # Rows in runs of num_ctas * 128, so every box height (a divisor of 128) gives each CTA
    # an equal run of whole boxes.
    cols, run = 2048, num_ctas * 128
    rows = run * (1 if args.interpret else max(1, round(args.mbytes * 1e6 / (run * cols * 2))))
    w = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32).astype(jnp.bfloat16)
    nbytes = rows * cols * 2
    log(f"device: {jax.devices()[0].device_kind}; w [{rows}, {cols}] bf16 = {nbytes / 1e6:.1f} MB; "
        f"{num_ctas} CTAs")
    # Interpret mode has no CUPTI: wall time (meaningless; the run checks the kernel runs).
    timer = (lambda f, *a: wall_time_ms(f, *a, iters=2)) if args.interpret else gpu_time_ms
    copy_ms = timer(jax.jit(lambda v: v + 1), w)
    copy_tbs = 2 * nbytes / (copy_ms * 1e-3) / 1e12
    log(f"device copy (read + write): {copy_ms * 1e3:.1f} us, {copy_tbs:.2f} TB/s")
    results, table = [], []
    for bk, bn in boxes:
        for stages in (int(s) for s in args.stages.split(",")):
            if stages * bk * bn * 2 > _common.SMEM_BUDGET:
                log(f"{bk}x{bn} x {stages} stages: over the SMEM budget, skipped")
                continue
            f = jax.jit(lambda v, b=(bk, bn), s=stages: stream(
                v, box=b, stages=s, num_ctas=num_ctas, interpret=args.interpret))
            ms = timer(f, w)
            tbs = nbytes / (ms * 1e-3) / 1e12
            row = dict(box=f"{bk}x{bn}", box_kb=bk * bn * 2 / 1024, stages=stages,
                       us=round(ms * 1e3, 1), tb_s=round(tbs, 3),
                       gb_s_per_sm=round(tbs * 1e3 / num_ctas, 1),
                       of_copy=round(tbs / copy_tbs, 3))
            log(json.dumps(row))
            results.append(row)
            table.append(f"| {row['box']} | {row['box_kb']:.0f} | {stages} | "
                         f"{stages * row['box_kb']:.0f} | {row['us']} | {row['tb_s']} | "
                         f"{row['gb_s_per_sm']} | {row['of_copy']} |")
    with open(os.path.join(args.out, "stream_probe.json"), "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, nbytes=nbytes, copy_tb_s=copy_tbs,
                       results=results), fh, indent=1)
    log("\n| box | KB | stages | KB in flight | us | TB/s | GB/s per SM | of copy |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(table))


if __name__ == "__main__":
    main()
