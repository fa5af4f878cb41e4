"""Session 28, call 6 (runs on `epilogue_warpgroup.patch` applied; the kernel was removed after
these measurements): is the epilogue warpgroup's K loop slowed by the consumers' register
cut (232 -> 184) or by the epilogue warpgroup's work? 7B up-proj, CUPTI, one run:
the 4-stage split-M kernel, its 3-stage K loop without an epilogue (call 2: 443 us), and the
epilogue-warpgroup form with the epilogue warpgroup at 104 / 72 registers (consumers 184 /
200) and with its stores removed (timing only)."""
import dataclasses
import sys

import jax

sys.path.insert(0, ".")
from benchmarks import timeline  # noqa: E402
from benchmarks.forward import SHAPES, gpu_time_ms, make_case  # noqa: E402
from pallas_moe.kernels import _common  # noqa: E402
from pallas_moe.kernels.moe_forward import split_m_up_config  # noqa: E402
from pallas_moe.kernels.up_proj import up_proj  # noqa: E402

x, w1, _, plan = make_case(SHAPES["7b"], skew=False, seed=3)
meta = jax.jit(lambda g, t: _common.tile_meta(g, t, 128))(plan.group_sizes, plan.token_ids)
base = dataclasses.replace(split_m_up_config(132), gather="cp_async")
epi = dataclasses.replace(base, num_stages=3, epilogue_tiles=0, epilogue_warpgroup=True)
rows = []


def time(name, cfg, ablation=None, regs=104):
    _common.EPILOGUE_REGISTERS = regs
    f = jax.jit(lambda x, t, g, w: up_proj(x, t, g, w, config=cfg, meta=meta))
    if ablation:
        with timeline.ablated(ablation):
            us = gpu_time_ms(f, x, plan.token_ids, plan.group_sizes, w1, iters=10) * 1e3
    else:
        us = gpu_time_ms(f, x, plan.token_ids, plan.group_sizes, w1, iters=10) * 1e3
    rows.append(f"| {name} | {us:.1f} |")
    print(rows[-1], flush=True)


time("split-M, 4 stages", base)
time("split-M, 3 stages, noepilogue", dataclasses.replace(base, num_stages=3), "noepilogue")
time("epilogue warpgroup, 104 regs (consumers 184)", epi)
time("epilogue warpgroup, 72 regs (consumers 200)", epi, regs=72)
time("epilogue warpgroup, 104 regs, nostore", epi, "nostore")
time("split-M, 4 stages (again)", base)
print("\n| 7B up-proj | CUPTI us |\n|---|---|\n" + "\n".join(rows))
