"""SmoothQuant CSR kernel, session 18, against session 17's kernel (`smoothquant_s17.py`),
same run, H100.

Versions (call 1: s17, splat_jnp, splat_rcp; call 2: s17, s18a, s18b, cur):
  s17        session 17's kernel (previous);
  splat_jnp  the row's scale and reciprocal on a warpgroup splat (no second warpgroup
             reduction per row), the jnp remainder-corrected reciprocal;
  splat_rcp  the same with `rcp.rn.f32` (call 1's tree; kept as `smoothquant_s18a.py`);
  s18a       = splat_rcp;
  s18b       s18a + the saturating conversions (`_saturating_quantize`: e4m3 cast without
             the clip, int8 `cvt.rni.sat.s8.f32`), `smoothquant_s18b.py`;
  s18c       s18b + X converted to f32 once per token instead of once per row (call 2's
             kept kernel, `smoothquant_s18c.py`);
  cur        s18c without the next-token prefetch when a CTA has one token (the tree);
  s18d       cur without the per-token X conversion (fewer registers), `smoothquant_s18d.py`.
Set QUANT_AB_VERSIONS to pick (default: call 3's) and QUANT_AB_CASES to pick cases. Cases, e4m3 and int8:
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



def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


OLD = {v: _load("smoothquant_" + v) for v in ("s17", "s18a", "s18b", "s18c", "s18d")}
VERSIONS = os.environ.get("QUANT_AB_VERSIONS", "s17,s18c,s18d,cur").split(",")
CASES = os.environ.get("QUANT_AB_CASES", "smoothed,one expert,plain,X per token").split(",")

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
    if version in OLD:
        return OLD[version].smoothquant_kernel(*args, **kw)
    saved = cur._rcp_rn
    if version == "splat_jnp":  # splat_rcp and cur: the tree as it is
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
            if case not in CASES:
                continue
            if case in ("one expert", "plain", "X per token") and dt == "int8":
                continue
            for block_t in bts:
                want = None
                cfg = SmoothQuantConfig(block_t=block_t)
                for ver in VERSIONS:
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
                        if case == "smoothed" and ver == VERSIONS[-1] and block_t == 1:
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
log("| shape | dtype | case | block_t | " + " | ".join(f"{v} us" for v in VERSIONS)
    + f" | s17/{VERSIONS[-1]} | {VERSIONS[-1]} of copy | bitwise |")
log("|---|---|---|---|" + "---|" * (len(VERSIONS) + 3))
by = {}
for r in rows_out:
    by.setdefault((r["shape"], r["dtype"], r["case"], r["block_t"]), {})[r["version"]] = r
for k, vs in by.items():
    got = [vs.get(v, {}) for v in VERSIONS]
    a, c = got[0], got[-1]
    ratio = f"{a['us'] / c['us']:.3f}" if "us" in a and "us" in c else ""
    eq = all(v.get("bitwise_equal_s17", False) for v in got)
    log(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(str(v.get("us", "err")) for v in got)
        + f" | {ratio} | {c.get('of_copy', '')} | {eq} |")
