"""Where a kernel's time goes inside it: Mosaic GPU's on-device profiler (run on an H100).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/timeline.py --out $OUT \
        [--shapes 7b,30b] [--kernels up,up_inference,dh,down,dx]

A kernel name is `up`, `dh`, `down`, `dx`, `dw1` / `dw2` (the weight gradients) and
`dhsplit` (the split dH's GEMM then row pass, `dh.dh_split`) with `--run-only` or `--plain`
only (they mark no regions) or `decode` (the decode megakernel, at the
`decode<T>` shapes only: the Qwen3-30B-A3B layer at T = 1, 8, 64, 128, 1024 tokens; its
regions: the producer's `post_wait`, `ids`, `empty_wait`, `weights`, `gather`, `publish`,
`event_wait`; the consumers' `task_wait`, `k_loop`, `epilogue`, `event_wait`), optionally
with a variant: `up_inference` (no
H), `up_pingpong` / `up_coop` (the persistent ping-pong kernel,
`UpProjConfig.pingpong_ctas`, the default for d <= 1536 / the cooperative kernel),
`_nostore` / `_nomath` / `_noepilogue` / `_halfweights` / `_nomma` / `_nofeed` / `_storel2` /
`_nowait` / `_lsuload` / `_lsuwrite` (`ablated`: timing only, wrong outputs), `_evictfirst`
(`stores_evict_first`) or `_packedbf16` (`packed_bf16_conversions`, the same bits); for
`dh`, `_swizzled` / `_hcpasync` (its swizzled epilogue slabs with H loaded by TMA boxes;
with H loaded by cp.async, the default: `DHConfig.h_loader`; `_untiled`, the untiled tiles
before session 21, went with them in session 42). Variants combine with `+`, e.g.
`up_pingpong+noepilogue+halfweights`; `up_pingpong+fused` sets `UpProjConfig.fused_gate_up`
(on W1 interleaved per block_n, the only layout it reads), `+interleaved` passes W1 with gate
and up interleaved per block_n (`gate_up_blocks`) to the two-wgmma kernels too,
and a `field=value` token sets any field of the kernel's config (`up_pingpong+num_stages=4`).
`--plain` skips the profiler and prints only the CUPTI times (a quick A/B of the ablations).

The kernels mark their phases with `jax.named_scope` (the up-proj: the producer's `ids`,
`loads` (in the ping-pong kernel, per K step: `empty_wait`, `weights`, `gather`, `publish`),
`drain`; the consumers' `k_loop`, `epilogue_sync`, `epilogue_math`,
`epilogue_store`; the persistent dH: `k_loop`, `epilogue_sync`, `h_load`, `epilogue`
(`dswiglu`, `store`); the grouped-GEMM engine's consumers (`down`, `dx`): `k_loop`,
`epilogue_math`, `previous_store`, `epilogue_store`). The
scopes cost nothing unless the kernel is compiled with `plgpu.CompilerParams.profile_space`:
this script sets it (for the kernel under test only), runs the kernel once, and reads the
trace Mosaic GPU dumps. Thread 0 of every warpgroup records `%clock` at each region's entry
and exit, and `%globaltimer` once at the CTA's start.

It prints, per kernel and warpgroup role, each region's median / p10 / p90 duration per
visit (cycles converted to us at the SM clock fitted from the trace, see `summarize`), the
sum per CTA, and the time between consecutive CTAs on an SM (launch and teardown,
one-CTA-per-tile kernels). The unprofiled kernel's CUPTI time is measured in the
same run, so the profiler's own cost shows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import subprocess
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.forward import (  # noqa: E402
    PINGPONG_UP, SHAPES, cooperative_up_cfg, gpu_time_ms, make_case,
)
from benchmarks.logs import open_log  # noqa: E402
from pallas_moe.kernels import _common  # noqa: E402
from pallas_moe.kernels import dh as dh_module  # noqa: E402
from pallas_moe.kernels.decode import DecodeConfig, moe_decode  # noqa: E402
from pallas_moe.kernels.dh import dh_kernel, dh_split  # noqa: E402
from pallas_moe.kernels.down_proj import down_proj  # noqa: E402
from pallas_moe.kernels.dx import dx_rows  # noqa: E402
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig  # noqa: E402
from pallas_moe.kernels.moe_backward import BackwardConfig  # noqa: E402
from pallas_moe.kernels.moe_forward import ForwardConfig  # noqa: E402
from pallas_moe.kernels.up_proj import interleave_gate_up, up_proj  # noqa: E402
from pallas_moe.kernels.weight_grad import weight_grad  # noqa: E402


@contextlib.contextmanager
def profiled(out_dir: str, regions: int):
    """Every Mosaic GPU kernel traced inside this context records up to `regions` named
    regions per warpgroup (bounds-checked) and dumps its trace into `out_dir`."""
    original = plgpu.CompilerParams

    def with_profile(**kwargs):
        return original(**kwargs, profile_space=regions, profile_dir=out_dir,
                        profile_bounds_check=True)

    plgpu.CompilerParams = with_profile
    try:
        yield
    finally:
        plgpu.CompilerParams = original


ABLATIONS = ("nostore", "nomath", "noepilogue", "halfweights", "nomma", "nofeed", "storel2",
             "nowait", "lsuload", "lsuwrite")
# "storel2" folds every output row into the first rows of its output (`STOREL2_ROWS`): the
# same stores (count, boxes, SMEM reads, TMA issue) on a footprint that stays in L2.
STOREL2_ROWS = 4096
KERNELS = ("up", "dh", "down", "dx", "decode", "dw1", "dw2", "dhsplit")
# The weight gradients and the split dH (its gathered GEMM `moe_dh_gemm`, then the row pass
# `moe_dh_rows`) have no named regions for the on-device profiler: they run only with
# --run-only (a target for Nsight Compute) or --plain.
UNPROFILED = ("dw1", "dw2", "dhsplit")
# The decode megakernel's shapes: the Qwen3-30B-A3B MoE layer at serving batch sizes.
DECODE_SHAPES = {f"decode{T}": (T, 2048, 768, 128, 8) for T in (1, 8, 64, 128, 1024)}


@contextlib.contextmanager
def ablated(what: str):
    """Traces kernels with a step of the epilogue removed (timing only: the outputs are
    wrong). "nostore": no output TMA stores (up-proj: H and A; dH: dH and A'); "nomath":
    the up-proj writes the rounded accumulators (no SwiGLU), dH writes dA', H gate and H up
    as dH and A' (no dSwiGLU; dS is the row sum of dA'); "noepilogue": both;
    "halfweights": `half_weight_copies`; "nomma": no wgmma is issued (the consumers still
    wait for every stage and release it: the time the feed alone takes; the accumulators
    stay zero); "nofeed": `no_feed` (the wgmmas alone, on stale stages); "storel2": every
    TMA store lands at its row modulo `STOREL2_ROWS` (7B up-proj: a 6-MB footprint of H
    and A, rewritten ~48 times, so L2 absorbs it instead of HBM): with "nostore", it tells
    whether the stores cost the K loop through the write traffic to HBM and L2 capacity
    (storel2 ~ nostore) or through issuing them, the TMA unit and L2 bandwidth (storel2 ~
    the full kernel). "nowait": every `wait_smem_to_gmem(..., wait_read_only=True)` is
    dropped (the epilogues overwrite staging tiles the TMA may still be reading): what
    waiting for the stores' SMEM reads costs (session 29, H200: nothing, 7B up-proj, dH
    and dX~ within 0.5%). "lsuload" / "lsuwrite" (`lsu_store_halves`): the row tiles'
    stores split into their two halves, each alone: every tile's SMEM bytes read by the
    warpgroup's own `ld.shared.v4` and never written out, or every tile's GMEM bytes written
    by `st.global.v4` with nothing read from SMEM (same rows, same addresses). Storing
    with the warpgroup's loads and stores instead of TMA (both halves) measured 0.98x on
    the 7B up-proj and 1.01x on dH (session 29, `history/session29/lsu_store.patch`), so
    the halves locate the stores' cost: SMEM reads (contending with the wgmmas' operand
    reads) or L2 writes."""
    if what not in ABLATIONS:
        raise ValueError(f"unknown ablation {what!r}")
    if what == "nowait":
        original = plgpu.wait_smem_to_gmem

        def wait_unless_read_only(n, wait_read_only=False):
            if not wait_read_only:
                original(n, wait_read_only=False)

        with _patched(plgpu, "wait_smem_to_gmem", wait_unless_read_only):
            yield
        return
    if what in ("lsuload", "lsuwrite"):
        with _patched(_common, "store_row_tile", lsu_store_halves(what[3:])):
            yield
        return
    if what in ("halfweights", "nomma", "nofeed"):
        # nomma: the consumers wait for every stage and release it, issuing no wgmma.
        with {"halfweights": half_weight_copies, "nofeed": no_feed,
              "nomma": lambda: _patched(plgpu, "wgmma", lambda *a, **k: None)}[what]():
            yield
        return
    saved = (_common.store_row_tile, _common.swiglu_epilogue, _common.store_rows,
             dh_module.dswiglu_epilogue)
    if what in ("nostore", "noepilogue"):
        _common.store_row_tile = lambda *a, **k: None
        _common.store_rows = lambda *a, **k: None
    if what == "storel2":  # `store_row_tile` calls the module's `store_rows`: fold once
        store_rows = saved[2]
        _common.store_rows = lambda src, dst, row0, *a, **k: store_rows(
            src, dst, row0 % STOREL2_ROWS, *a, **k)
    if what in ("nomath", "noepilogue"):
        _common.swiglu_epilogue = lambda g, u, dtype, *a, **k: (
            g.astype(dtype), g.astype(dtype), u.astype(dtype))
        dh_module.dswiglu_epilogue = lambda da, g, u, s, *a: (da, g, u, jnp.sum(da, axis=1))
    try:
        yield
    finally:
        (_common.store_row_tile, _common.swiglu_epilogue, _common.store_rows,
         dh_module.dswiglu_epilogue) = saved


@contextlib.contextmanager
def half_weight_copies():
    """Traces kernels whose expert-weight TMA copies (GMEM source sliced from a 3-D `[E, ., .]`
    weight) move half their bytes: the leading half of the stage's rows (of the up-proj's
    `[bk, bn]` gate and up stages, of dH's `[C*bn, bk]` W2 stage), and the wgmmas read the
    other half stale. Timing only: the outputs are wrong.
    The barrier protocol is unchanged (one copy, its own byte count). What it tests: whether
    the K loops are bound by the bytes moved from L2 into SMEM per FLOP (session 20: 40 KB
    per 2.1-MFLOP step in the ping-pong up-proj and the persistent dH), i.e. what a 2-CTA
    weight multicast would save."""
    original = plgpu.copy_gmem_to_smem

    def halved(src, dst, *args, **kwargs):
        base = getattr(src, "ref", src)
        shape = tuple(dst.shape)
        if len(getattr(base, "shape", ())) == 3 and len(shape) == 2 and shape[0] >= 16:
            # The leading half of the rows: contiguous in the (8, 64)-tiled stage.
            cut = (pl.ds(0, shape[0] // 2), slice(None))
            return original(src.at[cut], dst.at[cut], *args, **kwargs)
        return original(src, dst, *args, **kwargs)

    with _patched(plgpu, "copy_gmem_to_smem", halved):
        yield


@contextlib.contextmanager
def no_feed():
    """Traces kernels whose producer loads no operand: each TMA copy into a 16- or 8-bit
    buffer (the expert-weight stages, the TMA loader's gathered rows) becomes a plain arrival
    on its barrier, and the cp.async row gather issues no loads (its stage publishing is
    unchanged); token ids and scores still load. The consumers
    wait for and release every stage as before and their wgmmas read stale SMEM: the time
    the MMA side alone takes, the complement of `nomma`. Timing only: the outputs are wrong.
    Session 23: if feed alone and MMA alone are each well under the K loop, they contend
    for something they share (SMEM bandwidth: the gather's and the TMA's writes, the
    wgmmas' operand reads)."""
    original = plgpu.copy_gmem_to_smem

    def arrive_only(src, dst, barrier=None, *args, **kwargs):
        # Operand copies (bf16 / fp8 stages: expert weights, and the TMA loader's gathered
        # rows) arrive without moving data; token ids and scores (int32 / f32) still load.
        if barrier is not None and jnp.dtype(dst.dtype).itemsize <= 2:
            plgpu.barrier_arrive(barrier)
            return None
        return original(src, dst, barrier, *args, **kwargs)

    with _patched(plgpu, "copy_gmem_to_smem", arrive_only), \
            _patched(_common, "cp_async_gather_rows", lambda *a, **k: None):
        yield


@contextlib.contextmanager
def _patched(module, name: str, value):
    """`module.name` is `value` inside the context (kernels traced there use it)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def lsu_store_halves(half: str):
    """A `_common.store_row_tile` replacement that does one half of a row tile's store with
    the calling warpgroup's own 16-byte accesses (timing only). Thread t handles 16-byte
    chunk t % 8 of rows t // 8 + 16 p of each 128-byte slab. half="load": `ld.shared.v4`
    of every chunk (the 128-byte swizzle applied), then a `st.global.v4` predicated on
    `num_rows < 0`, never true, which keeps the loads; half="write": `st.global.v4` of
    every real row's chunk (rows < num_rows) with register values, no SMEM read. Ends with a
    warpgroup barrier, as a correct LSU store would."""
    if half not in ("load", "write"):
        raise ValueError(f"half must be 'load' or 'write', got {half!r}")

    def store(copy_view, dst_gmem, row0, num_rows, max_rows: int, src_row0=0) -> None:
        import jax.experimental.mosaic.gpu as mgpu
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm

        threads_per_row = _common.CP_ASYNC_ROW_THREADS
        rows_per_pass = 128 // threads_per_row
        chunk_bytes = _common.CP_ASYNC_BYTES
        line = _common.SWIZZLE_BYTES
        dtype = jnp.dtype(copy_view.dtype)
        w = line // dtype.itemsize
        src_type = plgpu.RefType(
            transforms=(plgpu.TilingTransform((1, w)), plgpu.SwizzleTransform(line)))
        scalar = plgpu.Layout.WG_SPLAT

        @plgpu.inline_mgpu(arg_types=(src_type, plgpu.RefType(), scalar, scalar, scalar))
        def _store(ctx, src, dst, first_dst_row, count, first_src_row):
            del ctx
            utils = mgpu.utils
            i32, i64, _, _ = _common._mlir_int_types()
            slabs = ir.MemRefType(src.type).shape[0]
            (row_stride, _), _ = ir.MemRefType(dst.type).get_strides_and_offset()
            first_dst_row, count, first_src_row = [
                v.registers.item() if hasattr(v, "registers") else v
                for v in (first_dst_row, count, first_src_row)]
            tid = arith.remui(utils.thread_idx(), utils.c(128, i32))
            chunk = arith.remui(tid, utils.c(threads_per_row, i32))
            row_in_pass = arith.divui(tid, utils.c(threads_per_row, i32))
            src_base = llvm.ptrtoint(i32, utils.memref_ptr(src))
            dst_base = llvm.ptrtoint(i64, llvm.addrspacecast(
                llvm.PointerType.get(address_space=1), utils.memref_ptr(dst)))
            dst_base = arith.addi(dst_base, arith.extui(
                i64, arith.muli(chunk, utils.c(chunk_bytes, i32))))
            never = arith.cmpi(arith.CmpIPredicate.slt, count, utils.c(0, i32))
            v4 = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
            for h in range(slabs):
                for p in range(max_rows // rows_per_pass):
                    row = arith.addi(row_in_pass, utils.c(p * rows_per_pass, i32))
                    dst_addr = arith.addi(dst_base, arith.addi(
                        arith.muli(arith.extui(i64, arith.addi(first_dst_row, row)),
                                   utils.c(row_stride * dtype.itemsize, i64)),
                        utils.c(h * line, i64)))
                    if half == "load":
                        src_row = arith.addi(first_src_row, row)
                        swizzled = arith.xori(chunk, arith.andi(src_row, utils.c(7, i32)))
                        src_addr = arith.addi(src_base, arith.addi(
                            arith.muli(arith.addi(src_row, utils.c(h * max_rows, i32)),
                                       utils.c(line, i32)),
                            arith.muli(swizzled, utils.c(chunk_bytes, i32))))
                        value = llvm.inline_asm(
                            v4, [src_addr], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                            "=r,=r,=r,=r,r", has_side_effects=True)
                        words = [llvm.extractvalue(i32, value, [k]) for k in range(4)]
                        predicate = never
                    else:
                        words = [arith.trunci(i32, dst_addr)] * 4
                        predicate = arith.cmpi(arith.CmpIPredicate.slt, row, count)
                    llvm.inline_asm(
                        ir.Type.parse("!llvm.void"), [predicate, dst_addr, *words],
                        "@$0 st.global.v4.b32 [$1], {$2, $3, $4, $5};", "b,l,r,r,r,r",
                        has_side_effects=True)
            utils.warpgroup_barrier()

        _store(copy_view, dst_gmem, jnp.asarray(row0, jnp.int32),
               jnp.asarray(num_rows, jnp.int32), jnp.asarray(src_row0, jnp.int32))

    return store


@contextlib.contextmanager
def stores_evict_first():
    """Traces kernels whose TMA stores (SMEM -> GMEM) carry an L2 `evict_first` cache
    policy (`createpolicy.fractional.L2::evict_first`), so the streamed outputs do not push
    the operands the next tiles reuse (weights, gathered rows, H) out of L2. The outputs are
    the same bits: a cache hint only."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import launch_context

    nvvm = launch_context.nvvm
    original = nvvm.cp_async_bulk_tensor_global_shared_cta

    def with_policy(tma_desc, smem_ptr, coords, predicate=None, **kwargs):
        # The NVVM op's own lowering takes no cache hint together with a predicate: the
        # store is written out as PTX here, the policy made in a register of its own block.
        if kwargs:
            raise NotImplementedError(f"store with {sorted(kwargs)}")
        if predicate is None:
            predicate = arith.constant(ir.IntegerType.get_signless(1), 1)
        rank = len(coords)
        idx = ",".join(f"${i}" for i in range(3, 3 + rank))
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"), [predicate, smem_ptr, tma_desc, *coords],
            "{\n.reg .b64 policy;\n"
            "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
            f"@$0 cp.async.bulk.tensor.{rank}d.global.shared::cta.tile.bulk_group"
            f".L2::cache_hint [$2, {{{idx}}}], [$1], policy;\n}}",
            "b,r,l" + ",r" * rank, has_side_effects=True)

    nvvm.cp_async_bulk_tensor_global_shared_cta = with_policy
    try:
        yield
    finally:
        nvvm.cp_async_bulk_tensor_global_shared_cta = original


@contextlib.contextmanager
def packed_bf16_conversions():
    """Traces kernels whose f32 -> bf16 conversions of two-element registers (the wgmma
    accumulator layout's, and the layouts of the epilogues' slabs) are one PTX
    `cvt.rn.bf16x2.f32` per register, instead of Mosaic GPU's `arith.truncf` on the vector,
    which Nsight Compute showed ptxas emitting as two `F2F.BF16.F32` plus a `PRMT` per pair
    (session 27, the up-proj's SwiGLU epilogue). Both round to nearest even: the outputs
    are the same bits (`packed_bf16.py` in benchmarks/history/session28 checks it).
    Session 29, H200: bitwise (the op's output and four gradients, 7B and 30B) and level
    (0.99-1.003x on the up-proj, dH, down-proj and dX~ at 7B and 30B): not adopted."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm, vector
    from jax.experimental.mosaic.gpu import fragmented_array, utils

    array = fragmented_array.FragmentedArray
    original = array.astype

    def astype(self, new_dtype, *, is_signed=None, rounding=None):
        reg_type = self.registers.flat[0].type
        if (rounding is not None or self.mlir_dtype != ir.F32Type.get()
                or new_dtype != ir.BF16Type.get()
                or not isinstance(reg_type, ir.VectorType)
                or tuple(ir.VectorType(reg_type).shape) != (2,)):
            return original(self, new_dtype, is_signed=is_signed, rounding=rounding)
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), new_dtype)
        registers = np.empty(self.registers.shape, dtype=object)
        for idx, reg in np.ndenumerate(self.registers):
            lo, hi = (vector.extract(reg, dynamic_position=[], static_position=[i])
                      for i in (0, 1))
            # cvt.rn.bf16x2.f32 d, a, b: a into the upper half, b into the lower.
            packed = llvm.inline_asm(i32, [hi, lo], "cvt.rn.bf16x2.f32 $0, $1, $2;",
                                     "=r,f,f", has_side_effects=False)
            registers[idx] = utils.bitcast(packed, pair)
        return array(_registers=registers, _layout=self.layout, _is_signed=None)

    array.astype = astype
    try:
        yield
    finally:
        array.astype = original


def sm_clock_mhz() -> float:
    """The SM clock nvidia-smi reports now (0 if it cannot be read)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.split()[0])
    except Exception:  # noqa: BLE001 - a missing reading only changes the unit
        return 0.0


def run_profiled(f, args, out_dir: str, regions: int):
    """Runs a fresh jit of f with the profiler on and returns (the dumped trace, parsed
    JSON; the SM clock sampled right after; the profiled jitted function, which dumps a
    trace into `out_dir` at every call)."""
    os.makedirs(out_dir, exist_ok=True)
    before = set(glob.glob(os.path.join(out_dir, "*-trace.json")))
    with profiled(out_dir, regions):
        g = jax.jit(lambda *a: f(*a))  # a new function object: traced with the profiler
        jax.block_until_ready(g(*args))  # compile + warm up: dumps a trace
        jax.block_until_ready(g(*args))
    jax.effects_barrier()
    mhz = sm_clock_mhz()
    new = sorted(set(glob.glob(os.path.join(out_dir, "*-trace.json"))) - before)
    if not new:
        raise RuntimeError("the profiled kernel dumped no trace")
    with open(new[-1]) as fh:
        return json.load(fh), mhz, g


def summarize(trace, num_wgs: int, roles: dict[int, str], mhz: float, log):
    """Per-region durations per role, CTA durations and the time between CTAs on an SM.

    Events of one trace (a warpgroup of a CTA): `ts` = (globaltimer at the CTA's start, ns
    + `%clock` cycles since the trace's first event) / 1e3, so within a trace differences
    are cycles / 1e3 and the first event is the CTA's start in wall ns / 1e3.

    The SM clock under load (what converts cycles to us) is fitted from the trace itself: on
    one SM the wall time from a CTA's start to the next CTA's start is (the first CTA's
    cycles) / f + gap, so a least-squares line over all such pairs gives 1 / f (slope) and
    the mean time from a CTA's last event to the next CTA's start (intercept). Without
    enough pairs (persistent kernels) `mhz` (nvidia-smi's reading, often the idle boost
    clock) converts instead."""
    by_tid: dict[int, list] = {}
    for ev in trace["traceEvents"]:
        by_tid.setdefault(ev["tid"], []).append(ev)
    cycles: dict[tuple[str, str], list[float]] = {}
    cta_span: dict[int, list] = {}  # block -> [start wall us, cycles to its last event, sm]
    for tid, evs in by_tid.items():
        block, wg = divmod(tid - 1, num_wgs)
        role = roles.get(wg, f"wg{wg}")
        t0 = evs[0]["ts"]
        stack = []
        for ev in evs:
            cyc = (ev["ts"] - t0) * 1e3
            if ev["ph"] == "B":
                stack.append((ev["name"], cyc))
            else:
                name, c0 = stack.pop()
                cycles.setdefault((role, name), []).append(cyc - c0)
        span = cta_span.setdefault(block, [t0, 0.0, evs[0]["pid"]])
        span[0] = min(span[0], t0)
        span[1] = max(span[1], (evs[-1]["ts"] - t0) * 1e3)
    per_sm: dict[int, list] = {}
    for start, cyc, sm in cta_span.values():
        per_sm.setdefault(sm, []).append((start, cyc))
    xs, ys = [], []
    for rows in per_sm.values():
        rows.sort()
        for a, b in zip(rows, rows[1:]):
            xs.append(a[1])  # cycles
            ys.append(b[0] - a[0])  # wall us
    fit = None
    if len(xs) > 10 and np.std(xs) > 0:
        slope, intercept = np.polyfit(np.asarray(xs), np.asarray(ys), 1)
        fit = (1.0 / slope, intercept)
    if fit is not None and 500 < fit[0] < 2500:
        cyc_per_us, clock_note = fit[0], "fitted from the trace"
    else:
        cyc_per_us = mhz if mhz > 0 else 1755.0
        clock_note = "nvidia-smi after the run" if mhz > 0 else "assumed"
    log(f"  SM clock {cyc_per_us:.0f} MHz ({clock_note}; nvidia-smi read {mhz:.0f})")
    log("  | role | region | visits | median us | p10 | p90 | sum per CTA us |")
    log("  |---|---|---|---|---|---|---|")
    num_blocks = len(cta_span)
    for (role, name), cs in sorted(cycles.items()):
        a = np.asarray(cs) / cyc_per_us
        log(f"  | {role} | {name} | {a.size} | {np.median(a):.2f} | {np.percentile(a, 10):.2f} | "
            f"{np.percentile(a, 90):.2f} | {a.sum() / max(num_blocks, 1):.2f} |")
    spans = [c / cyc_per_us for _, c, _ in cta_span.values()]
    starts = [s for s, _, _ in cta_span.values()]
    ends = [s + c / cyc_per_us for s, c, _ in cta_span.values()]
    counts = [len(rows) for rows in per_sm.values()]
    log(f"  CTAs {num_blocks} on {len(per_sm)} SMs ({min(counts)}-{max(counts)} each); "
        f"CTA recorded span median {np.median(spans):.2f} us; "
        f"first start to last end {max(ends) - min(starts):.1f} us")
    if fit is not None:
        log(f"  fit of CTA start-to-start wall time on its cycles ({len(xs)} pairs, cycles "
            f"p10-p90 {np.percentile(xs, 10):.0f}-{np.percentile(xs, 90):.0f}): SM clock "
            f"{fit[0]:.0f} MHz, time between one CTA's last event and the next CTA's start "
            f"{fit[1]:.2f} us (sum per SM {fit[1] * len(xs) / len(per_sm):.1f} us)")
    out = {f"{role}/{name}": float(np.median(cs) / cyc_per_us) for (role, name), cs in cycles.items()}
    out["clock_mhz"] = float(cyc_per_us)
    if fit is not None:
        out["fit_clock_mhz"], out["fit_gap_us"] = float(fit[0]), float(fit[1])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="7b,30b")
    ap.add_argument("--kernels", default="up,up_inference,dh")
    ap.add_argument("--traces", default="/tmp/timeline_traces",
                    help="where the raw traces go (one JSON per profiled call, MBs each)")
    ap.add_argument("--regions", type=int, default=0,
                    help="ping-pong up-proj: regions recorded per warpgroup (0 = 48)")
    ap.add_argument("--plain", action="store_true",
                    help="CUPTI times only, no profiled run (ablation A/B)")
    ap.add_argument("--run-only", action="store_true",
                    help="run each kernel 4 times, untimed: a target for Nsight Compute, whose "
                         "CUPTI subscription excludes the Mosaic profiler's")
    args = ap.parse_args()
    log = open_log(args.out, "timeline_log.txt")
    results = {}
    plain_rows = []
    for name in args.shapes.split(","):
        shape = {**SHAPES, **DECODE_SHAPES}[name]
        T, d, n, E, K = shape
        x, w1, w2, plan = make_case(shape, skew=False, seed=3)
        fcfg = ForwardConfig.for_shape(d, n)
        bcfg = BackwardConfig.for_shape(d, n)
        for kernel in args.kernels.split(","):
            # e.g. "up_nostore" -> "up", {"nostore"}; "up_coop+halfweights" -> "up", {...}
            base, _, variant = kernel.partition("_")
            variants = set(variant.split("+")) - {""}
            # "field=value" tokens override the kernel config's fields, e.g. num_stages=4.
            overrides = dict(v.split("=", 1) for v in variants if "=" in v)
            variants -= {v for v in variants if "=" in v}
            up_only = {"inference", "pingpong", "coop", "fused", "interleaved"}
            dh_only = {"swizzled", "hcpasync"}  # DHConfig.h_loader
            if base not in KERNELS \
                    or variants - {"evictfirst", "packedbf16", *up_only, *dh_only,
                                   *ABLATIONS} \
                    or (variants & up_only and base != "up") \
                    or (variants & dh_only and base != "dh") or {"pingpong", "coop"} <= variants:
                raise ValueError(f"unknown kernel {kernel!r}")
            variant_ctx = contextlib.ExitStack()
            if "evictfirst" in variants:  # same kernel, stores with an L2 hint
                variant_ctx.enter_context(stores_evict_first())
            if "packedbf16" in variants:  # same bits, paired f32 -> bf16 conversions
                variant_ctx.enter_context(packed_bf16_conversions())
            for ablation in sorted(variants & set(ABLATIONS)):  # traced with a step replaced
                variant_ctx.enter_context(ablated(ablation))
            if (base == "decode") != (name in DECODE_SHAPES):
                raise ValueError(f"kernel {kernel!r} at shape {name!r}: the decode kernel "
                                 f"runs at the {sorted(DECODE_SHAPES)} shapes, only it does")
            if base in UNPROFILED and not (args.run_only or args.plain):
                raise ValueError(f"kernel {kernel!r} marks no regions for the profiler: run it "
                                 "with --run-only (Nsight Compute) or --plain")
            split_gemm = bcfg.dh_gemm or GroupedMatmulConfig(  # the split below d = 2048 too
                block_m=128, block_n=256 if n % 256 == 0 else 128, num_stages=4, out_slabs=1)
            cfg = {"up": fcfg.up, "dh": bcfg.dh, "down": fcfg.down, "dx": bcfg.dx,
                   "decode": DecodeConfig.for_shape(d, n), "dw1": bcfg.dw_gate_up,
                   "dw2": bcfg.dw_down, "dhsplit": split_gemm}[base]
            if "pingpong" in variants:  # the persistent ping-pong up-proj
                cfg = PINGPONG_UP
            elif "coop" in variants:  # the cooperative up-proj (the default before session 20)
                cfg = cooperative_up_cfg(n)
            if "fused" in variants:  # one N = 2 * block_n wgmma per K step
                cfg = dataclasses.replace(cfg, fused_gate_up=True)
            if variants & dh_only:  # the dH's H loader
                cfg = dataclasses.replace(
                    cfg, h_loader="cp_async" if "hcpasync" in variants else "tma")
            if overrides:
                cfg = dataclasses.replace(cfg, **{
                    k: type(getattr(cfg, k))(v) if not isinstance(getattr(cfg, k), bool)
                    else v == "True" for k, v in overrides.items()})
            if base in ("up", "dh"):  # the gathering kernels' per-plan row tiles
                meta = jax.jit(lambda g, t, bm=cfg.tile_rows: _common.tile_meta(g, t, bm))(
                    plan.group_sizes, plan.token_ids)
                roles = {c: f"consumer{c}" for c in range(cfg.num_consumers)}
            if base == "up":
                inference = "inference" in variants  # ablations write H too

                # W1's layout: the fused up-proj reads interleaved W1 only.
                interleaved = "interleaved" in variants or cfg.fused_gate_up
                blocks = cfg.block_n if interleaved else 0

                def f(x, tok, g, w, cfg=cfg, meta=meta, inference=inference, blocks=blocks):
                    return up_proj(x, tok, g, w, config=cfg, meta=meta, inference=inference,
                                   gate_up_blocks=blocks)

                w_up = interleave_gate_up(w1, blocks) if blocks else w1
                fargs = (x, plan.token_ids, plan.group_sizes, w_up)
                wgs = cfg.num_consumers + 1
                roles[cfg.num_consumers] = "producer0"
                # The ping-pong kernel's CTAs walk ~47 items at 7B: record the first ones.
                regions = (args.regions or 48) if cfg.pingpong_ctas else 8
            elif base == "decode":
                def f(x, p, w1, w2, cfg=cfg):
                    return moe_decode(x, p, w1, w2, config=cfg)[0]

                fargs = (x, plan, w1, w2)
                wgs = 3
                roles = {0: "consumer0", 1: "consumer1", 2: "producer"}
                # The producer records ~5 regions per K step: a CTA's first tasks.
                regions = args.regions or 256
            elif base == "dh":
                h = jax.random.normal(jax.random.key(5), (plan.capacity, 2 * n),
                                      jnp.float32).astype(jnp.bfloat16)
                go = jax.random.normal(jax.random.key(6), (T, d), jnp.float32).astype(jnp.bfloat16)

                def f(go, h, tok, g, s, w, cfg=cfg, meta=meta):
                    return dh_kernel(go, h, tok, g, s, w, config=cfg, meta=meta)

                fargs = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
                wgs = cfg.num_consumers + 1
                roles[cfg.num_consumers] = "producer"
                tiles = meta.num_tiles
                ctas = cfg.persistent_ctas
                regions = 8 * (-(-tiles // ctas)) + 8
            elif base == "dhsplit":  # dA' = dO[tok] @ W2^T, then the dSwiGLU row pass
                h = jax.random.normal(jax.random.key(5), (plan.capacity, 2 * n),
                                      jnp.float32).astype(jnp.bfloat16)
                go = jax.random.normal(jax.random.key(6), (T, d), jnp.float32).astype(jnp.bfloat16)

                # dA' in the default split's dtype (bf16 where `for_shape` splits dH)
                da_dtype = bcfg.dh_da_dtype if bcfg.dh_gemm is not None else "bfloat16"

                def f(go, h, tok, g, s, w, cfg=cfg, da_dtype=da_dtype):
                    return dh_split(go, h, tok, g, s, w, gemm=cfg, da_dtype=da_dtype)

                fargs = (go, h, plan.token_ids, plan.group_sizes, plan.scores, w2)
            elif base in UNPROFILED:  # dW1 = X[tok]^T dH, dW2 = A'^T dO[tok] (varlen K)
                pad = -(-plan.capacity // cfg.block_k) * cfg.block_k
                grouped = jax.random.normal(jax.random.key(5), (pad, 2 * n if base == "dw1" else n),
                                            jnp.float32).astype(jnp.bfloat16)  # dH or A'
                tokens = x if base == "dw1" else jax.random.normal(
                    jax.random.key(6), (T, d), jnp.float32).astype(jnp.bfloat16)  # X or dO
                gathered = "lhs" if base == "dw1" else "rhs"

                def f(tokens, grouped, tok, g, cfg=cfg, gathered=gathered):
                    lhs, rhs = (tokens, grouped) if gathered == "lhs" else (grouped, tokens)
                    return weight_grad(lhs, rhs, tok, g, gathered=gathered,
                                       out_dtype=jnp.bfloat16, config=cfg)

                fargs = (tokens, grouped, plan.token_ids, plan.group_sizes)
            else:  # the persistent grouped-GEMM engine: down-proj or dX~
                pad = -(-plan.capacity // 128) * 128
                width, w = (n, w2) if base == "down" else (2 * n, w1)
                lhs = jax.random.normal(jax.random.key(5), (pad, width), jnp.float32
                                        ).astype(jnp.bfloat16)
                if base == "down":
                    def f(a, g, w, cfg=cfg):
                        return down_proj(a, g, w, config=cfg, capacity=plan.capacity)
                else:
                    def f(dh, g, w, cfg=cfg):
                        return dx_rows(dh, g, w, capacity=plan.capacity, config=cfg)
                fargs = (lhs, plan.group_sizes, w)
                wgs = 3
                roles = {0: "consumer0", 1: "consumer1", 2: "producer"}
                items = -(-(plan.capacity // cfg.block_m + E) * (d // cfg.block_n) // 132)
                regions = min(4 * items + 8, 48)  # the first items: SMEM is tight
            log(f"== {name} {shape} {kernel}: {cfg}")
            with variant_ctx:
                if args.run_only:
                    run = jax.jit(lambda *a: f(*a))
                    for _ in range(4):
                        jax.block_until_ready(run(*fargs))
                    log("  ran 4 times (--run-only)")
                    continue
                t_plain = gpu_time_ms(jax.jit(lambda *a: f(*a)), *fargs, iters=10)
                if args.plain:
                    log(f"  CUPTI: plain {t_plain * 1e3:.1f} us")
                    results[f"{name}/{kernel}"] = dict(plain_us=t_plain * 1e3)
                    plain_rows.append(f"| {name} | {kernel} | {t_plain * 1e3:.1f} |")
                    continue
                trace, mhz, profiled_f = run_profiled(
                    f, fargs, os.path.join(args.traces, f"{name}_{kernel}"), regions)
            # Timed after the trace was read: each call dumps another one next to it.
            t_prof = gpu_time_ms(profiled_f, *fargs, iters=5)
            log(f"  CUPTI: plain {t_plain * 1e3:.1f} us, profiled {t_prof * 1e3:.1f} us")
            results[f"{name}/{kernel}"] = dict(
                plain_us=t_plain * 1e3, profiled_us=t_prof * 1e3,
                regions=summarize(trace, wgs, roles, mhz, log))
    with open(os.path.join(args.out, "timeline.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    if plain_rows:
        log("\n| shape | kernel | CUPTI us |\n|---|---|---|\n" + "\n".join(plain_rows))


if __name__ == "__main__":
    main()
