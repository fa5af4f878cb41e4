"""One GPU: what the chunked EP overlap costs the down-proj (chunked vs whole, same run).

    # on one H100, from the repo root:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/chunked_down_proj.py
    # CPU smoke run of the script (interpret mode, tiny shape; timings meaningless):
    PYTHONPATH=. python benchmarks/chunked_down_proj.py --interpret --shapes tiny --iters 1

With `ExpertParallel(overlap="chunked")`, an expert shard runs its down-proj as C kernel
calls over `block_m`-aligned chunks of its received rows (`pallas_moe.ops.row_chunks`), so
each chunk's combine can start early. The tiles are the same as the whole down-proj's;
what chunking adds is C-1 more kernel launches, C persistent-kernel tails, and, as built,
one row-slice copy of A per chunk. This script measures, on one GPU, the down-proj of one
EP shard's rows (T*K/G rows over E/G local experts, top-K routing, optionally skewed):

- whole: one `down_proj` over all rows;
- chunked (kernels): C `down_proj` calls over pre-sliced chunks (the kernels alone);
- chunked (as built): the same with the row slices inside the timed function, as
  `chunked_row_ffn` runs it.

GPU kernel time by CUPTI (`benchmarks.forward.gpu_time_ms`, median of `--iters`). The
issue's target: chunked within 5% of whole. Prints a table and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_moe.kernels import _common
from pallas_moe.kernels.down_proj import down_proj
from pallas_moe.kernels.moe_forward import ForwardConfig
from pallas_moe.ops.row_chunks import chunk_group_sizes, chunk_layout
from pallas_moe.routing.topk import topk_plan

# name: (T global, d, n, E, K, G expert shards)
SHAPES = {
    "7b-ep8": (24576, 1536, 256, 128, 8, 8),
    "30b-ep8": (32768, 4096, 512, 128, 8, 8),
    "30b-ep4": (32768, 4096, 512, 128, 8, 4),
    "tiny": (512, 128, 128, 8, 2, 2),  # CPU smoke run only
}


def shard_rows(shape, skew: bool, seed: int = 0):
    """(a [R, n], group_sizes i32[E/G], w_down [E/G, n, d]): what one expert shard holds.

    The rows are the ones the whole batch routes to the first E/G experts (the shard's
    local experts), as the shard receives them.
    """
    num_tokens, d, n, num_experts, k, shards = shape
    local = num_experts // shards
    keys = jax.random.split(jax.random.key(seed), 3)
    logits = jax.random.normal(keys[0], (num_tokens, num_experts), jnp.float32)
    if skew:  # a quarter of the experts strongly preferred, as benchmarks/forward.py
        logits = logits + jnp.where(jnp.arange(num_experts) < num_experts // 4, 1.5, 0.0)
    plan = jax.jit(lambda l: topk_plan(l, k, score="softmax_topk"))(logits)
    group_sizes = plan.group_sizes[:local]
    rows = int(jnp.sum(group_sizes))
    a = (jax.random.normal(keys[1], (rows, n), jnp.float32)).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[2], (local, n, d), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
    return a, group_sizes, w_down


def run_shape(name, shape, args, time_ms):
    a, group_sizes, w_down = shard_rows(shape, args.skew)
    rows, n = a.shape
    d = w_down.shape[2]
    interpret = args.interpret
    config = ForwardConfig.for_shape(d, n, num_sms=4 if interpret else None).down
    bm = config.block_m
    capacity = -(-rows // bm) * bm
    a = jnp.pad(a, ((0, capacity - rows), (0, 0)))
    whole_meta = _common.aligned_tile_meta(group_sizes, capacity, bm)

    def whole(a, meta):
        return down_proj(a, group_sizes, w_down, config=config, interpret=interpret, meta=meta, capacity=capacity)

    y_whole = jax.jit(whole)(a, whole_meta)
    result = {"shape": name, "rows": rows, "local_experts": int(group_sizes.shape[0]), "block_m": bm,
              "whole_us": 1e3 * time_ms(jax.jit(whole), a, whole_meta)}
    for num_chunks in args.chunks:
        size, count = chunk_layout(capacity, num_chunks, bm)
        padded = jnp.pad(a, ((0, count * size - capacity), (0, 0)))
        sizes = chunk_group_sizes(group_sizes, size, count)  # [C, E_l]
        metas = [_common.aligned_tile_meta(sizes[c], size, bm) for c in range(count)]
        pieces = [padded[c * size:(c + 1) * size] for c in range(count)]

        def chunked_kernels(pieces, metas):
            return [
                down_proj(p, sizes[c], w_down, config=config, interpret=interpret, meta=m, capacity=size)
                for c, (p, m) in enumerate(zip(pieces, metas))
            ]

        def chunked_as_built(padded, metas):
            return chunked_kernels([padded[c * size:(c + 1) * size] for c in range(count)], metas)

        # Same rows out as the whole down-proj (the chunks' tiles are the whole's tiles).
        y_chunks = jnp.concatenate(jax.jit(chunked_kernels)(pieces, metas))[:rows]
        same = bool(jnp.array_equal(y_chunks, y_whole[:rows]))
        t_kernels = 1e3 * time_ms(jax.jit(chunked_kernels), pieces, metas)
        t_built = 1e3 * time_ms(jax.jit(chunked_as_built), padded, metas)
        result[f"c{num_chunks}"] = {
            "chunks": count, "chunk_rows": size, "bitwise_equal": same,
            "kernels_us": t_kernels, "as_built_us": t_built,
            "kernels_overhead": t_kernels / result["whole_us"] - 1,
            "as_built_overhead": t_built / result["whole_us"] - 1,
        }
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="7b-ep8,30b-ep8,30b-ep4", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--chunks", default="2,4", help="numbers of chunks to compare with the whole")
    parser.add_argument("--skew", action="store_true", help="skewed routing")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--interpret", action="store_true", help="Mosaic GPU interpret mode (CPU smoke run)")
    parser.add_argument("--target", type=float, default=0.05, help="max relative overhead (default 5%%)")
    parser.add_argument("--out", default=None, help="markdown path (default benchmarks/results/chunked_down_proj_<device>.md)")
    args = parser.parse_args(argv)
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    device = jax.devices()[0]
    if args.interpret:
        import time

        def time_ms(f, *a):  # wall time; the CPU smoke run only checks that the script works
            jax.block_until_ready(f(*a))
            start = time.perf_counter()
            for _ in range(args.iters):
                jax.block_until_ready(f(*a))
            return (time.perf_counter() - start) / args.iters * 1e3
    else:
        from benchmarks.forward import gpu_time_ms

        def time_ms(f, *a):
            return gpu_time_ms(f, *a, iters=args.iters)

    results = []
    failed = False
    for name in args.shapes.split(","):
        result = run_shape(name, SHAPES[name], args, time_ms)
        results.append(result)
        print(json.dumps(result), flush=True)
        for c in args.chunks:
            r = result[f"c{c}"]
            failed |= not r["bitwise_equal"] or (not args.interpret and r["as_built_overhead"] > args.target)
    lines = [
        f"# Down-proj cost of chunking (one EP shard's rows), {device.device_kind}"
        f"{' (interpret: timings meaningless)' if args.interpret else ''}",
        "",
        f"GPU kernel time (CUPTI), median of {args.iters}; routing {'skewed' if args.skew else 'random'} top-K; "
        f"target: chunked within {args.target:.0%} of whole.",
        "",
        "| shape | rows | E local | whole us | chunks | kernels us (+%) | as built us (+%) | equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for c in args.chunks:
            x = r[f"c{c}"]
            lines.append(
                f"| {r['shape']} | {r['rows']} | {r['local_experts']} | {r['whole_us']:.1f} | {x['chunks']} x "
                f"{x['chunk_rows']} | {x['kernels_us']:.1f} ({100 * x['kernels_overhead']:+.1f}%) | "
                f"{x['as_built_us']:.1f} ({100 * x['as_built_overhead']:+.1f}%) | {x['bitwise_equal']} |"
            )
    table = "\n".join(lines) + "\n"
    print(table)
    out = args.out or os.path.join(
        "benchmarks", "results", f"chunked_down_proj_{device.device_kind.replace(' ', '_')}.md"
    )
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
