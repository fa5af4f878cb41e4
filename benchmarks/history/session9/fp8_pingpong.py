"""fp8 down-proj: 128-row ping-pong vs the default split-M config (H100), bitwise + timing."""
import sys, os, dataclasses
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from benchmarks.forward import SHAPES, make_case, gpu_time_ms
from pallas_moe.kernels import _common
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
from pallas_moe.quant.ffn import Fp8ForwardConfig
from tests.test_quant_fp8 import fp8_operands

out = os.environ.get("OUT", ".")
logf = open(f"{out}/logs/fp8_pingpong_log.txt", "a")
def log(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); logf.write(s + "\n"); logf.flush()
rows_out = []
for name in sys.argv[1].split(","):
    T, d, n, E, K = SHAPES[name]
    _, _, _, plan = make_case(SHAPES[name], False, seed=3)
    P, rows = plan.capacity, int(plan.num_rows)
    a, w, rs, cs = fp8_operands(jax.random.key(9), P, n, d, E)  # A [P, n], W^T [E, d, n]
    base = Fp8ForwardConfig.for_shape(d, n).down
    G = GroupedMatmulConfig
    cfgs = {"default": base,
            "pp128_s5": G(block_m=128, block_n=128, block_k=128, num_stages=5, pingpong=True, fp8_promote_every=0),
            "pp128_s4": G(block_m=128, block_n=128, block_k=128, num_stages=4, pingpong=True, fp8_promote_every=0)}
    want, times = None, {}
    for rep in range(2):
        for label, cfg in cfgs.items():
            try:
                m = jax.jit(lambda g, bm=cfg.block_m: _common.aligned_tile_meta(g, P, bm))(plan.group_sizes)
                f = jax.jit(lambda a, g, w, r, c, m, cfg=cfg: grouped_matmul(
                    a, g, w, transpose_w=True, config=cfg, row_scales=r, col_scales=c, meta=m))
                if rep == 0:
                    junk = jnp.full((P * d,), jnp.nan, jnp.bfloat16); junk.block_until_ready(); del junk
                    y = np.asarray(jax.block_until_ready(f(a, plan.group_sizes, w, rs, cs, m))[:rows])
                    fin = bool(np.all(np.isfinite(y.astype(np.float32))))
                    if want is None:
                        want = y
                    bit = bool(np.array_equal(y, want))
                    log(f"{name} {label}: finite {fin} bitwise_vs_default {bit}")
                    if not (fin and bit):
                        continue
                t = gpu_time_ms(f, a, plan.group_sizes, w, rs, cs, m)
                times.setdefault(label, []).append(t * 1e3)
                log(f"{name} {label} rep{rep}: {t*1e3:.1f} us")
            except Exception as e:
                log(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
    b = min(times.get("default", [float("nan")]))
    for label, ts in times.items():
        rows_out.append((name, label, min(ts), b / min(ts)))
log("| shape | fp8 down-proj | us (best of 2) | default / variant |")
log("|---|---|---|---|")
for r in rows_out:
    log(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.3f} |")
