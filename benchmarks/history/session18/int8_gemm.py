"""The grouped GEMM's int8 mode (s8 x s8 -> s32 wgmma) against its e4m3 mode (the previous
8-bit kernel, same pipeline), H100, 7B and 30B shapes, top-K over random logits. (Call 6
also timed XLA's int8 einsum as a dense bound: 1000 us for the 7B up-proj's FLOPs, 2.6x
the int8 kernel's time, so it bounds nothing; dropped.)

Per shape: the gated up-proj gathering the tokens' 8-bit rows (`token_ids`, the fp8
forward's up-proj config) and the down-proj (the fp8 forward's down config), each in int8,
in e4m3 unpromoted (the same instruction count) and in e4m3 as the forward runs it
(promoted where its config promotes). Checks on outputs written after a poisoned buffer was
freed, on 256 sampled rows (the reference per row: exact s32 sums of the row against its
expert's W): int8 down (bf16 out, its config's) bitwise equal, int8 gated up (f32 out)
within 2e-6. Times: CUPTI medians (benchmarks.forward.gpu_time_ms).

    PYTHONPATH=. python3 benchmarks/history/session18/int8_gemm.py OUT 7b,30b
"""
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from benchmarks.forward import gpu_time_ms  # noqa: E402
import pallas_moe as pm  # noqa: E402
from pallas_moe.kernels.grouped_gemm import grouped_matmul  # noqa: E402
from pallas_moe.kernels.reference import fp8_grouped_matmul_reference  # noqa: E402
from pallas_moe.routing import topk_plan  # noqa: E402

SHAPES = {"7b": (24576, 1536, 256, 128, 8), "30b": (32768, 4096, 512, 128, 8)}
out_dir, names = sys.argv[1], sys.argv[2].split(",")
os.makedirs(out_dir, exist_ok=True)
logf = open(os.path.join(out_dir, "int8_gemm_log.txt"), "a")


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    logf.write(s + "\n")
    logf.flush()


def poisoned(f, *args, nbytes):
    junk = jnp.full((nbytes,), 0xFF, jnp.uint8).block_until_ready()
    del junk
    return jax.block_until_ready(f(*args))


rows = []
for name in names:
    T, d, n, E, K = SHAPES[name]
    plan = jax.jit(lambda l: topk_plan(l, K))(jax.random.normal(jax.random.key(1), (T, E)))
    P = plan.capacity
    cfg = pm.quant.Fp8ForwardConfig.for_shape(d, n)
    ks = jax.random.split(jax.random.key(2), 6)
    x8 = jax.random.randint(ks[0], (T, d), -127, 128).astype(jnp.int8)
    w1 = jax.random.randint(ks[1], (E, 2 * n, d), -127, 128).astype(jnp.int8)
    a8 = jax.random.randint(ks[2], (P, n), -127, 128).astype(jnp.int8)
    w2 = jax.random.randint(ks[3], (E, d, n), -127, 128).astype(jnp.int8)
    xs = jax.random.uniform(ks[4], (T,), jnp.float32, 1e-4, 1e-3)
    as_ = jax.random.uniform(ks[4], (P,), jnp.float32, 1e-4, 1e-3)
    c1 = jax.random.uniform(ks[5], (E, 2 * n), jnp.float32, 1e-4, 1e-3)
    c2 = jax.random.uniform(ks[5], (E, d), jnp.float32, 1e-4, 1e-3)
    e4 = lambda v: (v.astype(jnp.float32) * 3.0).astype(jnp.float8_e4m3fn)  # noqa: E731
    ops = {
        "up": dict(a=x8, w=w1, rs=xs, cs=c1, gated=True, cfg=cfg.up, ids=plan.token_ids,
                   flops=2 * P * d * 2 * n, out_n=n, k=d, nn=2 * n),
        "down": dict(a=a8, w=w2, rs=as_, cs=c2, gated=False, cfg=cfg.down, ids=None,
                     flops=2 * P * n * d, out_n=d, k=n, nn=d),
    }
    for op, o in ops.items():
        res = dict(shape=name, op=op)
        variants = {
            "int8": (o["a"], o["w"], o["cfg"]),
            "e4m3 unpromoted": (e4(o["a"]), e4(o["w"]),
                                dataclasses.replace(o["cfg"], fp8_promote_every=0)),
            "e4m3 (forward's config)": (e4(o["a"]), e4(o["w"]), o["cfg"]),
        }
        for label, (a, w, c) in variants.items():
            if label == "e4m3 (forward's config)" and not c.fp8_promote_every:
                continue
            extra = {} if o["ids"] is None else dict(token_ids=o["ids"])
            od = jnp.float32 if o["gated"] else jnp.bfloat16
            f = jax.jit(lambda a, w, rs, cs, c=c, g=o["gated"], extra=extra, od=od: grouped_matmul(
                a, plan.group_sizes, w, transpose_w=True, config=c, gated=g, row_scales=rs,
                col_scales=cs, out_dtype=od, **extra))
            try:
                got = poisoned(f, a, w, o["rs"], o["cs"], nbytes=P * o["out_n"] * 4 * 2)
                if label == "int8":
                    nr = int(plan.num_rows)
                    sample = np.sort(np.random.default_rng(0).choice(nr, 256, replace=False))
                    ids = sample if o["ids"] is None else np.asarray(o["ids"])[sample]
                    experts = np.searchsorted(np.cumsum(np.asarray(plan.group_sizes)), sample,
                                              side="right")
                    acc = jnp.einsum("rk,rnk->rn", o["a"][ids], o["w"][experts],
                                     preferred_element_type=jnp.int32).astype(jnp.float32)
                    deq = acc * o["rs"][ids][:, None] * o["cs"][experts]
                    if o["gated"]:
                        hg = deq[:, :n].astype(od).astype(jnp.float32)
                        hu = deq[:, n:].astype(od).astype(jnp.float32)
                        deq = hg * jax.nn.sigmoid(hg) * hu
                    g = np.asarray(got[sample].astype(jnp.float32))
                    wn = np.asarray(deq.astype(od).astype(jnp.float32))
                    res["int8_finite"] = bool(np.all(np.isfinite(g)))
                    if o["gated"]:
                        res["int8_max_rel"] = float(np.max(np.abs(g - wn)) / np.max(np.abs(wn)))
                        res["int8_ok"] = res["int8_finite"] and res["int8_max_rel"] < 2e-6
                    else:
                        res["int8_ok"] = bool(np.array_equal(g.view(np.uint32), wn.view(np.uint32)))
                t = gpu_time_ms(f, a, w, o["rs"], o["cs"])
                res[label + " us"] = round(t * 1e3, 1)
                res[label + " TOPS"] = round(o["flops"] / (t * 1e-3) / 1e12, 1)
            except Exception as e:  # noqa: BLE001 - report and go on
                res[label + " error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(json.dumps(res))
        rows.append(res)

json.dump(rows, open(os.path.join(out_dir, "int8_gemm.json"), "w"), indent=1)
log("| shape | op | int8 us (TOPS) | e4m3 unpromoted us | e4m3 forward's us | e4m3 unpromoted / int8 | int8 ok |")
log("|---|---|---|---|---|---|---|")
FWD = "e4m3 (forward's config) us"


def ratio(num, den):
    return f"{num / den:.3f}" if num and den else ""


for r in rows:
    i8, f8 = r.get("int8 us"), r.get("e4m3 unpromoted us")
    log(f"| {r['shape']} | {r['op']} | {i8} ({r.get('int8 TOPS')}) | {f8} | {r.get(FWD, '-')} | "
        f"{ratio(f8, i8)} | {r.get('int8_ok')} |")
