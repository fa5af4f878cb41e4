"""SmoothQuant kernel, session 10 (prefetch of the next token, no smooth load without smooth
scales) against session 9's (`smoothquant_v1.py`), same run, H100.

Cases: X per token (the fp8 forward's quantize_tokens: v1 with a ones row, v2 None), A's
requant (P rows of width n, one CSR entry each: v1 ones [E, n], v2 None), and the smoothed
MoE-SmoothQuant (K rows per token, E smooth rows). Each v2 output must equal v1's bit for
bit (poisoned outputs); times are CUPTI medians, and `of copy` divides the bytes the kernel
must move per second by a same-run device copy's.

    PYTHONPATH=. python3 benchmarks/history/session10/quant_ab.py OUT 7b,30b
"""
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from benchmarks.quant import gpu_time_ms, kernel_args, make_case, poison_then  # noqa: E402
from pallas_moe.quant import SmoothQuantConfig, smoothquant_kernel  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "smoothquant_v1", os.path.join(os.path.dirname(__file__), "smoothquant_v1.py"))
v1 = importlib.util.module_from_spec(spec)
sys.modules["smoothquant_v1"] = v1  # its dataclass looks its module up
spec.loader.exec_module(v1)

SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8),
          "tiny": (40, 256, 128, 4, 2)}  # tiny: CPU smoke run (QUANT_AB_INTERPRET=1)
INTERPRET = os.environ.get("QUANT_AB_INTERPRET") == "1"
if INTERPRET:
    gpu_time_ms = lambda f, *a: 1e-3  # noqa: E731 - no timings in interpret mode
E4M3 = jnp.float8_e4m3fn
out, names = sys.argv[1], sys.argv[2].split(",")
os.makedirs(out, exist_ok=True)
logf = open(os.path.join(out, "quant_ab_log.txt"), "a")


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    logf.write(s + "\n")
    logf.flush()


rows_out = []
for name in names:
    T, d, n, E, K = SHAPES[name]
    x, smooth, plan = make_case((T, d, E, K), "topk", seed=7)
    P = plan.capacity
    meta = jax.jit(kernel_args)(plan)
    copy_src = jax.random.normal(jax.random.key(3), (P, d), jnp.bfloat16)
    t_copy = gpu_time_ms(jax.jit(lambda v: v + 1), copy_src)
    copy_bps = 2 * P * d * 2 / (t_copy * 1e-3)
    a = (jax.random.normal(jax.random.key(4), (P, n), jnp.float32) * 3).astype(jnp.bfloat16)
    rows = jnp.arange(P + 1, dtype=jnp.int32)
    a_meta = (jnp.minimum(rows, plan.num_rows), rows[:-1], jnp.minimum(plan.expert_ids, E - 1),
              plan.num_rows)
    tok = jnp.arange(T + 1, dtype=jnp.int32)
    x_meta = (tok, tok[:-1], jnp.zeros((T,), jnp.int32), None)
    cases = {  # name: (input, v1 smooth, v2 smooth, metadata, out rows, bytes to move)
        "X per token": (x, jnp.ones((1, d), jnp.float32), None, x_meta, T, T * d * 3 + 4 * T),
        "A requant": (a, jnp.ones((E, n), jnp.float32), None, a_meta, P, P * n * 3 + 4 * P),
        "smoothed K rows": (x, smooth, smooth, meta, P, T * d * 2 + P * d + 4 * P),
    }
    only = os.environ.get("QUANT_AB_CASES")
    blocks = [int(b) for b in os.environ.get("QUANT_AB_BLOCKS", "1,4,16,64").split(",")]
    for case, (inp, s1, s2, m, out_rows, nbytes) in cases.items():
        if only and case not in only.split(","):
            continue
        want = None
        for block_t in blocks:
            cfg = SmoothQuantConfig(block_t=block_t)
            for ver, kern, sm in (("v1", v1.smoothquant_kernel, s1), ("v2", smoothquant_kernel, s2)):
                f = jax.jit(lambda i, s, a0, a1, a2, a3, kern=kern, cfg=cfg, r=out_rows: kern(
                    i, s, a0, a1, a2, a3, num_out_rows=r, out_dtype=E4M3, config=cfg, interpret=INTERPRET))
                try:
                    q, s = poison_then(f, inp, sm, *m, nbytes=out_rows * (d + 4) * 2, byte=0xFF)
                    q = np.asarray(q).view(np.uint8)
                    s = np.asarray(s).view(np.uint32)
                    if want is None:
                        want = (q, s)
                    same = bool(np.array_equal(q, want[0]) and np.array_equal(s, want[1]))
                    t = gpu_time_ms(f, inp, sm, *m)
                    row = dict(shape=name, case=case, block_t=block_t, version=ver,
                               us=round(t * 1e3, 1), of_copy=round(nbytes / (t * 1e-3) / copy_bps, 3),
                               bitwise_equal=same)
                except Exception as e:  # noqa: BLE001 - report and go on
                    row = dict(shape=name, case=case, block_t=block_t, version=ver,
                               error=f"{type(e).__name__}: {str(e)[:200]}")
                log(json.dumps(row))
                rows_out.append(row)
    log(json.dumps(dict(shape=name, copy_us=round(t_copy * 1e3, 1), copy_GBs=round(copy_bps / 1e9))))

json.dump(rows_out, open(os.path.join(out, "quant_ab.json"), "w"), indent=1)
log("| shape | case | block_t | v1 us | v2 us | v1/v2 | v2 of copy | bitwise |")
log("|---|---|---|---|---|---|---|---|")
key = lambda r: (r["shape"], r["case"], r["block_t"])  # noqa: E731
by = {}
for r in rows_out:
    by.setdefault(key(r), {})[r["version"]] = r
for k, vs in by.items():
    a, b = vs.get("v1", {}), vs.get("v2", {})
    if "us" in a and "us" in b:
        log(f"| {k[0]} | {k[1]} | {k[2]} | {a['us']} | {b['us']} | {a['us'] / b['us']:.3f} | "
            f"{b['of_copy']} | {a['bitwise_equal'] and b['bitwise_equal']} |")
    else:
        log(f"| {k[0]} | {k[1]} | {k[2]} | {a.get('us', a.get('error'))} | {b.get('us', b.get('error'))} | | | |")
