"""Session 54: runs the SmoothQuant CSR kernel once per `shape:config` case, for Nsight
Compute (`ncu --kernel-name regex:smoothquant`): what limits it at 7B and d = 7168 now.

    python3 benchmarks/history/session54/quant_profile.py 7b:default,d7168:default,d7168:smem0

Configs: default (the op's at that width), smem0 (scale rows straight into registers),
smem2 (2 rows staged in SMEM). int8 output, top-K plans (as `benchmarks/quant.py`).
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.quant import SHAPES, kernel_args, make_case  # noqa: E402
from pallas_moe.quant import SmoothQuantConfig, smoothquant_kernel  # noqa: E402

CONFIGS = {"default": SmoothQuantConfig(), "smem0": SmoothQuantConfig(scale_rows_smem=0),
           "smem2": SmoothQuantConfig(scale_rows_smem=2)}

for case in sys.argv[1].split(","):
    name, cfg = case.split(":")
    x, smooth, plan = make_case(SHAPES[name], "topk", seed=11)
    args = (x, smooth, *jax.jit(kernel_args)(plan))
    f = jax.jit(lambda x, s, o, r, e, n, P=plan.capacity, c=CONFIGS[cfg]: smoothquant_kernel(
        x, s, o, r, e, n, num_out_rows=P, out_dtype=jnp.int8, config=c))
    jax.block_until_ready(f(*args))
    print(f"ran {case}", flush=True)
