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

`--up-phase U:S:stages,...` adds the megakernel's up phase at T = 1 itself (session 32): the
8 routed experts' W1 `[8 d, 2n]` at the Qwen3 widths, one CTA per up task (`8 n / U * S`:
96 at U = 64, S = 1), each loading a `[64, U]` gate and a `[64, U]` up box per K step in
*strip* order (its column block, down the K rows: a 128-byte piece of every 3-KB row at
U = 64), against the same CTAs taking the same bytes in *row* order (whole rows, box after
box), so the only difference is which bytes a CTA's steps touch.

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


def up_phase_box(cta: int, step: int, *, d: int, n: int, u: int, split: int,
                 order: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two `[64, u]` boxes (row, column in box units) CTA `cta` loads at K step `step`
    of the up phase over W1 `[experts * d, 2n]`; works on ints and on traced scalars.

    "strips": the decode megakernel's up task (or its part of `split` with split K): expert
    `e`, column block `cb`, K steps down the rows; the gate box at column `cb`, the up box
    at `n / u + cb`. "rows": the same number of boxes per CTA taken in row-major order.
    """
    blocks, steps = n // u, d // 64 // split
    if order == "strips":
        task, part = cta // split, cta % split
        row = (task // blocks) * (d // 64) + part * steps + step
        cb = task % blocks
        return (row, cb), (row, blocks + cb)
    if order == "rows":
        flat = (cta * steps + step) * 2  # 2 * blocks boxes per row, an even count
        return ((flat // (2 * blocks), flat % (2 * blocks)),
                ((flat + 1) // (2 * blocks), (flat + 1) % (2 * blocks)))
    raise ValueError(f"order must be 'strips' or 'rows', got {order!r}.")


def stream_up_phase(w: jax.Array, *, d: int, n: int, u: int, split: int, stages: int,
                    order: str, interpret: bool = False) -> jax.Array:
    """Streams W1 `w` bf16 [experts * d, 2n] as the decode megakernel's up phase does at
    T = 1 (`up_phase_box`): `experts * n / u * split` CTAs, `d / 64 / split` K steps each,
    `stages` steps (two boxes each) in flight. Returns an unused i32 per CTA."""
    rows, cols = w.shape
    if cols != 2 * n or rows % d or n % u or (d // 64) % split:
        raise ValueError(f"w must be [experts * {d}, {2 * n}] with n % u == 0 and d / 64 % split "
                         f"== 0; got {tuple(w.shape)}, u={u}, split={split}.")
    num_ctas = rows // d * (n // u) * split
    steps = d // 64 // split
    spec = lambda which: plgpu.BlockSpec(  # noqa: E731
        (64, u), lambda j: up_phase_box(jax.lax.axis_index("cta"), j, d=d, n=n, u=u,
                                        split=split, order=order)[which],
        transforms=_common.mma_transforms(w.dtype))

    def body(w_ref, out_ref):
        del out_ref

        def step(_, gate_smem, up_smem):  # both boxes landed; release them
            del gate_smem, up_smem

        plgpu.emit_pipeline(step, grid=(steps,), in_specs=[spec(0), spec(1)],
                            max_concurrent_steps=stages)(w_ref, w_ref)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((num_ctas,), jnp.int32), grid=(num_ctas,),
        grid_names=("cta",), kernel_name="stream_probe_up",
        interpret=_common.interpret_params(interpret),
    )(w)


def rate_row(ms: float, nbytes: int, num_ctas: int, copy_tbs: float, **fields) -> dict:
    """`fields` plus the time and rates of streaming `nbytes` in `ms` on `num_ctas` CTAs."""
    tbs = nbytes / (ms * 1e-3) / 1e12
    return dict(**fields, us=round(ms * 1e3, 1), tb_s=round(tbs, 3),
                gb_s_per_sm=round(tbs * 1e3 / num_ctas, 1), of_copy=round(tbs / copy_tbs, 3))


def up_phase_table(args, log, timer, copy_tbs) -> list[dict]:
    """Times `stream_up_phase` for every `U:S:stages` of `--up-phase`, strips then rows."""
    d, n, experts = (256, 128, 2) if args.interpret else (2048, 768, 8)
    w = jax.random.normal(jax.random.key(1), (experts * d, 2 * n), jnp.float32).astype(jnp.bfloat16)
    nbytes = w.size * 2
    log(f"up phase: W1 of {experts} experts [{experts * d}, {2 * n}] bf16 = {nbytes / 1e6:.1f} MB")
    rows = []
    for spec in args.up_phase.split(","):
        u, split, stages = (int(v) for v in spec.split(":"))
        for order in ("strips", "rows"):
            f = jax.jit(lambda v, u=u, s=split, st=stages, o=order: stream_up_phase(
                v, d=d, n=n, u=u, split=s, stages=st, order=o, interpret=args.interpret))
            ms = timer(f, w)
            ctas = experts * (n // u) * split
            row = rate_row(ms, nbytes, ctas, copy_tbs, u=u, split=split, stages=stages,
                           order=order, ctas=ctas)
            log(json.dumps(row))
            rows.append(row)
    log("\n| U | S | stages | order | CTAs | us | TB/s | GB/s per SM | of copy |\n"
        "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(
            f"| {r['u']} | {r['split']} | {r['stages']} | {r['order']} | {r['ctas']} | {r['us']} | "
            f"{r['tb_s']} | {r['gb_s_per_sm']} | {r['of_copy']} |" for r in rows))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--mbytes", type=float, default=75.5,
                    help="matrix size (the 8 experts' weights at T = 1: 75.5 MB)")
    ap.add_argument("--boxes", default="64x64,64x128,64x256,128x128")
    ap.add_argument("--stages", default="2,3,4,5,6,8")
    ap.add_argument("--up-phase", default="",
                    help="U:S:stages,... the decode up phase in strip vs row order (empty: skip)")
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    log = open_log(args.out, "stream_probe_log.txt")
    num_ctas = 4 if args.interpret else default_num_sms()
    boxes = [tuple(int(v) for v in b.split("x")) for b in args.boxes.split(",") if b]
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
    up_rows = up_phase_table(args, log, timer, copy_tbs) if args.up_phase else []
    results, table = [], []
    for bk, bn in boxes:
        for stages in (int(s) for s in args.stages.split(",")):
            if stages * bk * bn * 2 > _common.SMEM_BUDGET:
                log(f"{bk}x{bn} x {stages} stages: over the SMEM budget, skipped")
                continue
            f = jax.jit(lambda v, b=(bk, bn), s=stages: stream(
                v, box=b, stages=s, num_ctas=num_ctas, interpret=args.interpret))
            ms = timer(f, w)
            row = rate_row(ms, nbytes, num_ctas, copy_tbs, box=f"{bk}x{bn}",
                           box_kb=bk * bn * 2 / 1024, stages=stages)
            log(json.dumps(row))
            results.append(row)
            table.append(f"| {row['box']} | {row['box_kb']:.0f} | {stages} | "
                         f"{stages * row['box_kb']:.0f} | {row['us']} | {row['tb_s']} | "
                         f"{row['gb_s_per_sm']} | {row['of_copy']} |")
    with open(os.path.join(args.out, "stream_probe.json"), "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, nbytes=nbytes, copy_tb_s=copy_tbs,
                       results=results, up_phase=up_rows), fh, indent=1)
    log("\n| box | KB | stages | KB in flight | us | TB/s | GB/s per SM | of copy |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(table))


if __name__ == "__main__":
    main()
