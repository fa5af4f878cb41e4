"""Session 25: the SmoothQuant CSR kernel with each load's address loaded a row earlier
(the expert id two rows ahead, the next row's scale row and output row in the loop carry)
against session 24's kernel (`smoothquant_s24.py`, where the next row's scale load waited on
its expert id's load inside the row), same run. Top-K over random logits, smoothed rows
(the MoE-SmoothQuant op's kernel), block_t = 1 (the op's default), e4m3 and int8. The new
kernel's output must equal the old one's bit for bit (poisoned outputs) and an independent
numpy formula on 4096 sampled rows; `of copy` = the bytes the op must move per second over a
same-run device copy's.

    PYTHONPATH=. python3 benchmarks/history/session25/quant_ab.py OUT 7b,30b

`QUANT_AB_VERSIONS` (default "s24,cur", call 7) picks the versions: also "fadd" (int8 rounded by an f32 add, not `cvt.rni.sat.s8.f32`), "ahead2" and
"ahead3" (`SmoothQuantConfig.scale_rows_ahead`, scale rows 2 or 3 rows ahead) and "bt2"
(two tokens per CTA, the next token's X row and CSR bounds prefetched); the first version is
the reference of the bitwise check and the speed-up.
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
from pallas_moe.quant import kernel as cur  # noqa: E402



def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(__file__), name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


# s24: session 24's kernel; cur: the tree with its defaults (call 7's kernel); fadd: int8
# rounded by an f32 add (`int8_rounding="fadd"`).
ALL = {"s24": (_load("smoothquant_s24"), {}),
       "cur": (cur, {}), "fadd": (cur, dict(int8_rounding="fadd")), "ahead2": (cur, dict(scale_rows_ahead=2)),
       "ahead3": (cur, dict(scale_rows_ahead=3)), "bt2": (cur, dict(block_t=2)),
       "ahead2_bt2": (cur, dict(scale_rows_ahead=2, block_t=2))}
VERSIONS = {v: ALL[v] for v in os.environ.get("QUANT_AB_VERSIONS", "s24,cur").split(",")}
SHAPES = {"7b": (24576, 1536, 128, 8), "30b": (32768, 4096, 128, 8), "tiny": (40, 256, 4, 2)}
INTERPRET = os.environ.get("QUANT_AB_INTERPRET") == "1"
if INTERPRET:
    gpu_time_ms = lambda f, *a: 1e-3  # noqa: E731


def main(out, names):
    os.makedirs(out, exist_ok=True)
    rows = []
    for name in names:
        T, d, E, K = SHAPES[name]
        x, smooth, plan = make_case((T, d, E, K), "topk", seed=11)
        P = plan.capacity
        meta = jax.jit(kernel_args)(plan)
        src = jax.random.normal(jax.random.key(3), (P, d), jnp.bfloat16)
        t_copy = gpu_time_ms(jax.jit(lambda v: v + 1), src)
        copy_bps = 2 * P * d * 2 / (t_copy * 1e-3)
        nbytes = T * d * 2 + P * d + 4 * P
        for out_dtype in (jnp.float8_e4m3fn, jnp.int8):
            want = None
            for ver, (mod, fields) in VERSIONS.items():
                cfg = mod.SmoothQuantConfig(**fields)
                f = jax.jit(lambda i, s, a0, a1, a2, a3, mod=mod, od=out_dtype, cfg=cfg:
                            mod.smoothquant_kernel(i, s, a0, a1, a2, a3, num_out_rows=P,
                                                   out_dtype=od, config=cfg,
                                                   interpret=INTERPRET))
                q, s = poison_then(f, x, smooth, *meta, nbytes=P * (d + 4) * 2, byte=0xFF)
                q, s = np.asarray(q).view(np.uint8), np.asarray(s).view(np.uint32)
                want = want or (q, s)
                row = dict(shape=name, dtype=jnp.dtype(out_dtype).name, version=ver,
                           bitwise_equal_first=bool(np.array_equal(q, want[0])
                                                  and np.array_equal(s, want[1])))
                if ver != next(iter(VERSIONS)):
                    xs, ss = np.asarray(x.astype(jnp.float32)), np.asarray(smooth)
                    r = np.asarray(meta[1])[:4096]
                    toks = np.repeat(np.arange(T), np.diff(np.asarray(meta[0])))[:4096]
                    wq, ws = numpy_rows(xs, ss, toks, np.asarray(meta[2])[:4096],
                                        jnp.dtype(out_dtype))
                    row["numpy_mismatches"] = int(np.sum(q[r] != np.asarray(wq).view(np.uint8))
                                                  + np.sum(s[r] != np.asarray(ws, np.float32)
                                                           .view(np.uint32)))
                t = gpu_time_ms(f, x, smooth, *meta)
                row.update(us=round(t * 1e3, 1), of_copy=round(nbytes / (t * 1e-3) / copy_bps, 3))
                print(json.dumps(row), flush=True)
                rows.append(row)
    json.dump(rows, open(os.path.join(out, "quant_ab.json"), "w"), indent=1)
    names = list(VERSIONS)
    print("| shape | dtype | " + " | ".join(f"{v} us (of copy)" for v in names)
          + f" | {names[0]} / {names[-1]} | bitwise | numpy mismatches |")
    print("|---|---|" + "---|" * (len(names) + 3))
    for i in range(0, len(rows), len(names)):
        got = rows[i:i + len(names)]
        print(f"| {got[0]['shape']} | {got[0]['dtype']} | "
              + " | ".join(f"{r['us']} ({r['of_copy']})" for r in got)
              + f" | {got[0]['us'] / got[-1]['us']:.3f} | "
              + f"{all(r['bitwise_equal_first'] for r in got)} | "
              + f"{sum(r.get('numpy_mismatches', 0) for r in got)} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
