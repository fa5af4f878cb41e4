"""The expert-bias gradients of the kernel backward (db1, db2, dS's b2 term), against the
previous version, paired in the same run (run on an H100).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bias_grads.py [--shapes gpt-oss-20b,30b]
    PYTHONPATH=. python3 benchmarks/bias_grads.py --smoke     # CPU: tiny shape, wall clock

`pallas_moe.ops.minimal_backward.expert_bias_gradients` computes them as three dense
products over the plan (session 50). The previous version (`scan_bias_gradients` below,
kept here only as this benchmark's baseline) walked the plan's 128-row tiles 8 at a time in
a `lax.scan`, cast to fp32; in gpt-oss-20b's step on the H100 its fusions took ~1.5 ms of
13.1. For each shape (top-K routing over random logits, random bf16 dH, dO and b2) it checks
that both agree with each other (relative error) and are bitwise the same on a second call,
times both with CUPTI (GPU kernel time) over `--rounds` paired rounds, and prints a table
last (log.txt in --out).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import jax
import jax.numpy as jnp

from benchmarks.forward import SHAPES, gpu_time_ms, interleaved_times_ms
from benchmarks.logs import open_log
from pallas_moe.ops.minimal_backward import expert_bias_gradients
from pallas_moe.ops.xla import scan_row_tiles
from pallas_moe.routing import topk_plan

SMOKE_SHAPE = (64, 128, 64, 4, 2)  # (T, d, n, E, K)


def scan_bias_gradients(dh, plan, grad_out, b_down, *, block_m=128, tiles_per_step=8):
    """The previous `expert_bias_gradients` (until session 50), this benchmark's baseline:
    a scan over the plan's row tiles in ascending expert order, each tile's rows summed in
    fp32 and added to its expert's total one tile after another."""
    num_experts, d = b_down.shape
    two_n = dh.shape[1]
    grad_out = grad_out.astype(dh.dtype)

    def step(carry, rows, valid, tok, s, e):  # [c, bm] x4, [c]
        ds_b, db1, db2 = carry
        slot_is_row = valid[..., None]
        dh_t = jnp.where(slot_is_row, dh[rows].astype(jnp.float32), 0.0)  # [c, bm, 2n]
        do_t = jnp.where(slot_is_row, grad_out[tok].astype(jnp.float32), 0.0)  # [c, bm, d]
        ds_t = jnp.einsum("cmd,cd->cm", do_t, b_down[e].astype(jnp.float32))
        ds_b = ds_b.at[jnp.where(valid, rows, plan.capacity).reshape(-1)].set(
            ds_t.reshape(-1), mode="drop")
        db1_t = jnp.sum(dh_t, axis=1)  # [c, 2n]
        db2_t = jnp.einsum("cm,cmd->cd", s, do_t)  # [c, d]
        for i in range(rows.shape[0]):
            db1 = db1.at[e[i]].add(db1_t[i])
            db2 = db2.at[e[i]].add(db2_t[i])
        return ds_b, db1, db2

    init = (jnp.zeros((plan.capacity,), jnp.float32),
            jnp.zeros((num_experts, two_n), jnp.float32),
            jnp.zeros((num_experts, d), jnp.float32))
    return scan_row_tiles(plan, step, init, block_m=block_m, tiles_per_step=tiles_per_step)


def make_case(shape, seed):
    """(dH [P_pad, 2n], plan, dO [T, d], b2 [E, d]) of one shape, bf16, top-K routing."""
    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(seed), 4)
    plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(ks[0], (T, E)))
    rows = -(-plan.capacity // 64) * 64
    dh = jax.random.normal(ks[1], (rows, 2 * n), jnp.float32).astype(jnp.bfloat16)
    grad_out = jax.random.normal(ks[2], (T, d), jnp.float32).astype(jnp.bfloat16)
    b_down = jax.random.normal(ks[3], (E, d), jnp.float32).astype(jnp.bfloat16)
    return dh, plan, grad_out, b_down


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def wall_ms(f, *args, iters=3):
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(f(*args))
    return (time.perf_counter() - start) / iters * 1e3


def run_shape(name, shape, rounds, smoke, log):
    args = make_case(shape, seed=len(name))
    new, old = jax.jit(expert_bias_gradients), jax.jit(scan_bias_gradients)
    got, want, again = new(*args), old(*args), new(*args)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    bitwise = all(bool(jnp.array_equal(g, a)) for g, a in zip(got, again))
    log(f"== {name} {shape}: rel err dS_b / db1 / db2 against the previous version "
        f"{errs[0]:.1e} / {errs[1]:.1e} / {errs[2]:.1e}, bitwise repeat {bitwise}")
    (t_old, _, s_old), (t_new, speedup, s_new) = interleaved_times_ms(
        [(old, args), (new, args)], rounds, time_ms=wall_ms if smoke else gpu_time_ms)
    log(f"  previous (scan) {t_old * 1e3:.1f} us (spread {s_old:.1%}), dense products "
        f"{t_new * 1e3:.1f} us (spread {s_new:.1%}): x{speedup:.2f} paired")
    return dict(name=name, err=max(errs), bitwise=bitwise, old_us=t_old * 1e3,
                new_us=t_new * 1e3, speedup=speedup)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="gpt-oss-20b,30b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shape, wall clock")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    log = open_log(args.out, "bias_grads_log.txt")
    shapes = {"smoke": SMOKE_SHAPE} if args.smoke else {
        s: SHAPES[s] for s in args.shapes.split(",")}
    results = [run_shape(name, shape, args.rounds, args.smoke, log)
               for name, shape in shapes.items()]
    log("| shape | previous (scan) us | dense products us | speed-up, paired | max rel err | bitwise repeat |")
    log("|---|---|---|---|---|---|")
    for r in results:
        log(f"| {r['name']} | {r['old_us']:.1f} | {r['new_us']:.1f} | {r['speedup']:.2f}x "
            f"| {r['err']:.1e} | {r['bitwise']} |")


if __name__ == "__main__":
    main()
