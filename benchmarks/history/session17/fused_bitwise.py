"""Session 17, device only: the fused gate/up split-M up-proj (`fused_gate_up`) against the
same tiles with two wgmmas and against the default, bitwise, on fresh 7B / 30B data with
poisoned outputs.

    git apply benchmarks/history/session17/fused_gate_up_experiment.patch
    PYTHONPATH=. python3 benchmarks/history/session17/fused_bitwise.py 7b,30b

(`fused_gate_up` is not on main: it measured no faster, see benchmarks/RESULTS.md.)
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import SHAPES, make_case, poison_then
from pallas_moe.kernels import _common
from pallas_moe.kernels.moe_forward import ForwardConfig
from pallas_moe.kernels.up_proj import UpProjConfig, up_proj

for name in sys.argv[1].split(","):
    T, d, n, E, K = shape = SHAPES[name]
    x, w1, _, plan = make_case(shape, False, seed=17)
    rows = int(plan.num_rows)
    P = plan.capacity
    outs = {}
    split = UpProjConfig(block_m=128, block_n=128, num_stages=4, num_consumers=2, gather="cp_async")
    for label, cfg in [("default", ForwardConfig.for_shape(d, n).up), ("split", split),
                       ("fused", UpProjConfig(**{**split.__dict__, "fused_gate_up": True}))]:
        meta = _common.tile_meta(plan.group_sizes, plan.token_ids, cfg.block_m)
        f = jax.jit(lambda x, t, g, w, m, cfg=cfg: up_proj(x, t, g, w, config=cfg, meta=m))
        h, a = poison_then(f, x, plan.token_ids, plan.group_sizes, w1, meta, nbytes=P * 3 * n * 2)
        outs[label] = (np.asarray(h[:rows]), np.asarray(a[:rows]))
    for label in ("split", "fused"):
        same = all(np.array_equal(o, r) for o, r in zip(outs[label], outs["default"]))
        finite = all(np.isfinite(o.astype(np.float32)).all() for o in outs[label])
        print(f"{name}: {label} bitwise equal to default: {same}, finite: {finite}")
    same = all(np.array_equal(o, r) for o, r in zip(outs["fused"], outs["split"]))
    print(f"{name}: fused bitwise equal to split: {same}")
