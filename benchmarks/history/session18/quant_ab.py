"""SmoothQuant CSR kernel, session 18 (the row's scale and reciprocal on a warpgroup splat,
`rcp.rn.f32` on the GPU: no second warpgroup reduction per row, no remainder correction)
against session 17's kernel (`smoothquant_s17.py`), same run, H100.

Versions: s17 (previous), splat_jnp (this session's kernel with the jnp remainder-corrected
reciprocal on the splat), splat_rcp (this session's kernel). Cases, e4m3 and int8:
  smoothed     the MoE-SmoothQuant op: K rows per token, each smoothed by its expert's row;
  one expert   diagnostic: every row smoothed by expert 0's row (the same instructions,
               the scale row stays in L1: what the L2 traffic of the scale rows costs);
  plain        diagnostic: smooth None with the same CSR rows (each token quantized once,
               stored K times: the store floor);
  X per token  the fp8 forward's per-token quantization.
Every version's output must equal s17's bit for bit (poisoned outputs). Times are CUPTI
medians; `of copy` divides the bytes the op must move per second by a same-run device
copy's.

    PYTHONPATH=. python3 benchmarks/history/session18/quant_ab.py OUT 7b,30b
"""
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from benchmarks.quant import gpu_time_ms, kernel_args, make_case, numpy_rows, poison_then  # noqa: E402
from pallas_moe.quant import SmoothQuantConfig  # noqa: E402
from pallas_moe.quant import kernel as cur  # noqa: E402
from pallas_moe.quant.reference import correctly_rounded_reciprocal  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "smoothquant_s17", os.path.join(os.path.dirname(__file__), "smoothquant_s17.py"))
s17 = importlib.util.module_from_spec(spec)
sys.modules["smoothquant_s17"] = s17
spec.loader.exec_module(s17)

SHAPES = {"7b": (24576, 1536, 128, 8), "30b": (32768, 4096, 128, 8), "tiny": (40, 256, 4, 2)}
INTERPRET = os.environ.get("QUANT_AB_INTERPRET") == "1"
if INTERPRET:
    gpu_time_ms = lambda f, *a: 1e-3  # noqa: E731
out, names = sys.argv[1], sys.argv[2].split(",")
os.makedirs(out, exist_ok=True)
logf = open(os.path.join(out, "quant_ab_log.txt"), "a")


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    logf.write(s + "\n")
    logf.flush()


def run(version, *args, **kw):
    if version == "s17":
        return s17.smoothquant_kernel(*args, **kw)
    saved = cur._rcp_rn
    if version == "splat_jnp":
        cur._rcp_rn = correctly_rounded_reciprocal
    try:
        return cur.smoothquant_kernel(*args, **kw)
    finally:
        cur._rcp_rn = saved


rows_out = []
blocks = [int(b) for b in os.environ.get("QUANT_AB_BLOCKS", "1,2,4").split(",")]
for name in names:
    T, d, E, K = SHAPES[name]
    x, smooth, plan = make_case((T, d, E, K), "topk", seed=11)
    P = plan.capacity
    meta = jax.jit(kernel_args)(plan)
    one_meta = (meta[0], meta[1], jnp.zeros_like(meta[2]), meta[3])
    copy_src = jax.random.normal(jax.random.key(3), (P, d), jnp.bfloat16)
    t_copy = gpu_time_ms(jax.jit(lambda v: v + 1), copy_src)
    copy_bps = 2 * P * d * 2 / (t_copy * 1e-3)
    tok = jnp.arange(T + 1, dtype=jnp.int32)
    x_meta = (tok, tok[:-1], jnp.zeros((T,), jnp.int32), None)
    op_bytes = T * d * 2 + P * d + 4 * P
    cases = {  # name: (smooth, metadata, out rows, bytes, block sizes)
        "smoothed": (smooth, meta, P, op_bytes, blocks),
        "one expert": (smooth, one_meta, P, op_bytes, [1]),
        "plain": (None, meta, P, op_bytes, [1]),
        "X per token": (None, x_meta, T, T * d * 3 + 4 * T, [1]),
    }
    for out_dtype in (jnp.float8_e4m3fn, jnp.int8):
        dt = jnp.dtype(out_dtype).name
        for case, (sm, m, out_rows, nbytes, bts) in cases.items():
            if case in ("one expert", "plain", "X per token") and dt == "int8":
                continue
            for block_t in bts:
                want = None
                cfg = SmoothQuantConfig(block_t=block_t)
                for ver in ("s17", "splat_jnp", "splat_rcp"):
                    f = jax.jit(lambda i, s, a0, a1, a2, a3, ver=ver, cfg=cfg, r=out_rows, od=out_dtype: run(
                        ver, i, s, a0, a1, a2, a3, num_out_rows=r, out_dtype=od, config=cfg,
                        interpret=INTERPRET))
                    row = dict(shape=name, dtype=dt, case=case, block_t=block_t, version=ver)
                    try:
                        q, s = poison_then(f, x, sm, *m, nbytes=out_rows * (d + 4) * 2, byte=0xFF)
                        q = np.asarray(q).view(np.uint8)
                        s = np.asarray(s).view(np.uint32)
                        if want is None:
                            want = (q, s)
                        row["bitwise_equal_s17"] = bool(np.array_equal(q, want[0]) and np.array_equal(s, want[1]))
                        if case == "smoothed" and ver == "splat_rcp" and block_t == 1:
                            # Independent numpy formula on a sample of rows.
                            xs, ss = np.asarray(x.astype(jnp.float32)), np.asarray(smooth)
                            rows = np.asarray(meta[1])[:4096]
                            toks = np.repeat(np.arange(T), np.diff(np.asarray(meta[0])))[:4096]
                            wq, ws = numpy_rows(xs, ss, toks, np.asarray(meta[2])[:4096], jnp.dtype(out_dtype))
                            row["numpy_q_mismatch"] = int(np.sum(q[rows] != np.asarray(wq).view(np.uint8)))
                            row["numpy_s_mismatch"] = int(np.sum(s[rows] != np.asarray(ws, np.float32).view(np.uint32)))
                        t = gpu_time_ms(f, x, sm, *m)
                        row.update(us=round(t * 1e3, 1), of_copy=round(nbytes / (t * 1e-3) / copy_bps, 3))
                    except Exception as e:  # noqa: BLE001 - report and go on
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    log(json.dumps(row))
                    rows_out.append(row)
    log(json.dumps(dict(shape=name, copy_us=round(t_copy * 1e3, 1), copy_GBs=round(copy_bps / 1e9))))

json.dump(rows_out, open(os.path.join(out, "quant_ab.json"), "w"), indent=1)
log("| shape | dtype | case | block_t | s17 us | splat_jnp us | splat_rcp us | s17/rcp | rcp of copy | bitwise |")
log("|---|---|---|---|---|---|---|---|---|---|")
by = {}
for r in rows_out:
    by.setdefault((r["shape"], r["dtype"], r["case"], r["block_t"]), {})[r["version"]] = r
for k, vs in by.items():
    a, b, c = vs.get("s17", {}), vs.get("splat_jnp", {}), vs.get("splat_rcp", {})
    us = [v.get("us", "err") for v in (a, b, c)]
    ratio = f"{a['us'] / c['us']:.3f}" if "us" in a and "us" in c else ""
    eq = all(v.get("bitwise_equal_s17", False) for v in (a, b, c))
    log(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {us[0]} | {us[1]} | {us[2]} | {ratio} | {c.get('of_copy', '')} | {eq} |")
