"""Session 30: the up-proj's two kernels at the wide-expert 7B shapes, alone, on the plan
forward.py builds (random logits) and on the plan step.py builds (x @ router), same process.
Call 4 saw split-M lose to the ping-pong inside the step (0.598 vs 0.547 ms at 7b-n512)
although forward.py had it 1.12x faster alone.

    PYTHONPATH=. python3 benchmarks/history/session30/up_plans.py
"""
import dataclasses
import sys

import jax

sys.path.insert(0, ".")
import pallas_moe as pm  # noqa: E402
from benchmarks.forward import PINGPONG_UP, SHAPES, gpu_time_ms, make_case  # noqa: E402
from benchmarks.step import step_inputs  # noqa: E402
from pallas_moe.kernels import _common  # noqa: E402
from pallas_moe.kernels.moe_forward import ForwardConfig, default_num_sms  # noqa: E402
from pallas_moe.kernels.up_proj import up_proj  # noqa: E402
from pallas_moe.nn.functional import router_logits  # noqa: E402

rows = []
for name in ("7b-n512", "7b-n1024"):
    T, d, n, E, K = SHAPES[name]
    x, w1, _, plan_fwd = make_case(SHAPES[name], False, seed=1)
    xs, router, w1s, _, _ = step_inputs(SHAPES[name], 0)
    plan_step = jax.jit(lambda x, r: pm.routing.topk_plan(router_logits(x, r, dtype="bfloat16"), K))(xs, router)
    cfgs = {"split-M (default)": ForwardConfig.for_shape(d, n).up,
            "ping-pong": dataclasses.replace(PINGPONG_UP, pingpong_ctas=default_num_sms())}
    for plan_name, (xx, ww, plan) in {"forward.py plan": (x, w1, plan_fwd),
                                      "step.py plan": (xs, w1s, plan_step)}.items():
        for cname, cfg in cfgs.items():
            meta = jax.jit(lambda g, t, b=cfg.block_m: _common.tile_meta(g, t, b))(plan.group_sizes, plan.token_ids)
            f = jax.jit(lambda x, t, g, w, m, c=cfg: up_proj(x, t, g, w, config=c, meta=m))
            t_ms = gpu_time_ms(f, xx, plan.token_ids, plan.group_sizes, ww, meta)
            rows.append((name, plan_name, cname, t_ms * 1e3, int(plan.num_rows), plan.capacity))
            print(rows[-1], flush=True)
print("| shape | plan | kernel | us | rows | capacity |\n|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]} | {r[5]} |")
