"""Do dH's epilogue stores wait on each other across SMs? (issue 9, session 57)

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/history/session57/dh_stagger.py 7b,30b [rounds] [variants]

Session 56 measured the stores of dH and A' at 21% of dH at 7B (`no_store` 1.275x): 101 us for
302 MB, i.e. 3.0 TB/s, the HBM's write rate. The persistent CTAs do equal work per item, so
they may reach their epilogues together and write in bursts that the HBM serializes (the L2
is write-back and full of dirty lines in steady state), while the tensor cores idle. If so,
CTAs that start out of phase should spread the writes over the K loops of the others.

Variants (beside session 55's `dh_ablation.py` ones, `default` first):
  stagP  the producer of CTA c spins `(c % P) * item / P` ns on `%globaltimer` before its
         first item, where `item` is the default's measured time per item of one CTA; only
         CTAs with the fewer items are delayed (the others start at once), so the makespan
         grows by at most one item's share. Checked bitwise against the default (poisoned).

If stag2 / stag4 are clearly faster than the default (paired, over the spread), a start
offset (or a walk order that keeps CTAs out of phase) is a real lever; if level, the
stores' cost is per SM, and only an epilogue whose SMEM does not block the next K loop can
hide them.
"""

from __future__ import annotations

import functools
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, "benchmarks/history/session55")
import dh_ablation  # noqa: E402

from benchmarks.backward import SHAPES, make_case  # noqa: E402
from benchmarks.forward import gpu_time_ms  # noqa: E402
from pallas_moe.kernels import _common, dh as dh_mod  # noqa: E402
from pallas_moe.kernels.moe_backward import BackwardConfig  # noqa: E402

SPIN_PTX = """{
.reg .u64 t0, t1;
.reg .pred p;
mov.u64 t0, %globaltimer;
add.u64 t0, t0, $0;
SPIN_UNTIL:
mov.u64 t1, %globaltimer;
setp.lt.u64 p, t1, t0;
@p bra SPIN_UNTIL;
}"""


def spin_ns(delay) -> None:
    """Every thread of the calling warpgroup spins until `delay` (i32 scalar) ns passed."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT(shape=()),))
    def _spin(ctx, ns):
        del ctx
        i64 = ir.IntegerType.get_signless(64)
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [arith.extui(i64, ns.registers.item())],
                        SPIN_PTX, "l", has_side_effects=True)

    _spin(jnp.asarray(delay, jnp.int32))


def staggered(phases: int, step_ns: int, first_short: int):
    original = _common.role_registers

    def role_registers(role, num_consumers):
        original(role, num_consumers)
        if role == "producer":
            cta = jax.lax.axis_index("cta")
            delay = jnp.where(cta >= first_short, (cta % phases) * step_ns, 0)
            spin_ns(delay)

    return role_registers


def main():
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["7b", "30b"]
    rounds = sys.argv[2] if len(sys.argv) > 2 else "3"
    variants = sys.argv[3].split(",") if len(sys.argv) > 3 else ["default", "stag2", "stag4"]
    for name in shapes:
        T, d, n, E, K = shape = SHAPES[name]
        cfg = BackwardConfig.for_shape(d, n).dh
        # The default's time per item of one CTA, from one quick timing (its compile is cached
        # for the paired rounds that follow).
        x, w1, w2, plan, go = make_case(shape, seed=len(name) * 7 + 1)
        h = dh_ablation.saved_h(x, plan, w1)
        meta = jax.jit(lambda g, t: _common.tile_meta(g, t, cfg.tile_rows))(
            plan.group_sizes, plan.token_ids)
        f = jax.jit(functools.partial(dh_mod.dh_kernel, config=cfg, meta=meta))
        args = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
        us = statistics.median(gpu_time_ms(f, *args) * 1e3 for _ in range(3))
        num_items = meta.num_tiles * (n // dh_mod.item_cols(cfg))
        ctas = min(cfg.persistent_ctas, num_items)
        per_cta = -(-num_items // ctas)
        first_short = num_items % ctas or ctas  # CTAs [first_short, ctas) have one item less
        item_ns = us * 1e3 / per_cta
        print(f"== {name}: default {us:.1f} us, {num_items} items on {ctas} CTAs, "
              f"{item_ns / 1e3:.2f} us per item, delayed CTAs from {first_short}", flush=True)
        for v in variants:
            if v.startswith("stag"):
                phases = int(v[4:])
                dh_ablation.PATCHES[v] = [(_common, "role_registers",
                                           staggered(phases, int(item_ns / phases), first_short))]
                dh_ablation.OVERRIDES[v] = {}
        del x, w1, w2, plan, go, h, meta, f, args
        sys.argv = [sys.argv[0], name, rounds, ",".join(variants)]
        dh_ablation.main()


if __name__ == "__main__":
    main()
