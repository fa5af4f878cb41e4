"""Issue 9: the split dH's GEMM (dA' = dO[tok] @ W2[e]^T, bf16 out since session 63) with
more of its output staged in SMEM, against the default (4 stages, one 64-column slab per
consumer), same run, paired rounds.

Why: session 63 found the GEMM 85 us faster at 30B with bf16 dA' (1.709 -> 1.624 ms in the
step's profile), about the time its 268 MB fewer output bytes take at copy speed, so its
epilogue stores are not hidden under its K loop. Its one staged slab per consumer makes each
of an item's 4 store rounds wait for the previous round's TMA store to read the slab. A
ring of two slabs (`out_buffers=2`), two slabs a round (`out_slabs=2`), or the whole tile
with one stage fewer lets the stores overlap. Also timed, for the K loop: `wgmma_lag=0` and
the hardware-tracked cp.async stages (`gather_completion="mbarrier"`), never timed on this
GEMM. Prediction: one of them takes the GEMM 3-5%
faster at 30B (1624 -> ~1560 us) and at the Qwen3 widths; refuted if none beats the default
by more than the rounds' spread.

Checks first, on poisoned outputs: every variant's dA' bitwise the default's (the staging
does not change the products). Times the GEMM alone and the whole split (GEMM + row pass).
Usage: PYTHONPATH=. python3 benchmarks/history/session63/dh_gemm_out.py 30b,qwen3-30b-a3b [rounds]
"""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.backward import SHAPES, gpu_time_ms, make_case, poison_then, saved_h
from benchmarks.forward import SHAPES as FORWARD_SHAPES
from benchmarks.forward import interleaved_times_ms
from pallas_moe.kernels import _common
from pallas_moe.kernels.dh import dh_split
from pallas_moe.kernels.grouped_gemm import grouped_matmul, smem_bytes
from pallas_moe.kernels.moe_backward import BackwardConfig, dh_split_gemm_config


def candidates(base, n):
    """The default and its staged-output variants that fit a CTA's SMEM."""
    rep = dataclasses.replace
    out = [base]
    for c in (rep(base, out_buffers=2), rep(base, out_slabs=2),
              rep(base, num_stages=3, out_slabs=0),
              rep(base, num_stages=3, out_slabs=1, out_buffers=4),
              # Not the output: each slot released as soon as its own wgmmas are done, and
              # hardware-tracked cp.async stages (both bitwise, never timed on this GEMM).
              rep(base, wgmma_lag=0), rep(base, gather_completion="mbarrier")):
        try:
            fits = smem_bytes(c, n, in_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
                              gathered=True) <= _common.SMEM_MAX
        except ValueError:  # the config refuses itself (e.g. more buffers than rounds)
            fits = False
        if fits:
            out.append(c)
    return out


def main():
    names = (sys.argv[1] if len(sys.argv) > 1 else "30b,qwen3-30b-a3b").split(",")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    table = []
    for name in names:
        shape = SHAPES.get(name) or FORWARD_SHAPES[name]
        T, d, n, E, K = shape
        x, w1, w2, plan, go = make_case(shape, seed=13)
        P = plan.capacity
        rows = int(plan.num_rows)
        h = jax.block_until_ready(saved_h(x, plan, w1))
        cfg = BackwardConfig.for_shape(d, n)
        base = cfg.dh_gemm or dh_split_gemm_config(cfg.dh.persistent_ctas)
        meta = jax.jit(lambda gs: _common.aligned_tile_meta(gs, P, base.tile_rows))(
            plan.group_sizes)
        gemm_args = (go, plan.group_sizes, w2, plan.token_ids)
        split_args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
        print(f"== {name} {shape}: default {base}", flush=True)
        gemms, splits, ref = [], [], None
        for c in candidates(base, n):
            g = jax.jit(lambda go, gs, w, t, c=c: grouped_matmul(
                go, gs, w, transpose_w=True, config=c, capacity=P, out_dtype=jnp.bfloat16,
                token_ids=t, meta=meta))
            got = np.asarray(poison_then(g, *gemm_args, nbytes=P * n * 2), np.float32)[:rows]
            ref = got if ref is None else ref
            same = np.array_equal(got, ref) and np.all(np.isfinite(got))
            label = (f"stages {c.num_stages} out_slabs {c.out_slabs} out_buffers "
                     f"{c.out_buffers} lag {c.wgmma_lag} {c.gather_completion}")
            print(f"  {label}: dA' bitwise the default {same}", flush=True)
            if not same:
                table.append((name, label, "not bitwise: not timed", ""))
                continue
            s = jax.jit(lambda *a, c=c: dh_split(
                *a, gemm=c, meta=meta, pad_rows_to=cfg.dh.pad_rows_to,
                da_dtype=jnp.bfloat16))
            gemms.append((label, g, gemm_args))
            splits.append((label, s, split_args))
        for kind, variants in (("GEMM", gemms), ("split", splits)):
            times = interleaved_times_ms([(f, a) for _, f, a in variants], rounds,
                                         lambda f, *a: gpu_time_ms(f, *a))
            first = times[0][0]
            for (label, _, _), (t, _, spread) in zip(variants, times):
                table.append((name, f"{kind}: {label}", f"{t * 1e3:.1f}",
                              f"{first / t:.3f} (spread {spread:.1%})"))
                print(f"  {kind} {label}: {t * 1e3:.1f} us, default / this {first / t:.3f} "
                      f"(spread {spread:.1%})", flush=True)
        del h
    print("\n| shape | variant | us | default / this |\n|---|---|---|---|")
    for r in table:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |")


if __name__ == "__main__":
    main()
