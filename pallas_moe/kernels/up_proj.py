"""Up-projection: varlen-M grouped GEMM with the token gather fused into the A load, and a
SwiGLU epilogue.

    H[r] = X[tok[r]] @ W1[e(r)] + b1[e(r)]    bf16 [P, 2n]   (kept for the backward)
    A[r] = act(H[r, :n], H[r, n:])            bf16 [P, n]

`act` is the `SwiGLU` spec: `silu(gate) * up`, or gpt-oss's clamped variant. The optional
expert bias b1 ([E, 2n]) is added to the fp32 accumulators before H is rounded, so H is
the biased pre-activation and the backward recomputes A from it exactly
(`_common.swiglu_epilogue`). Each CTA (or consumer) TMA-loads its bias columns into SMEM
once per tile, before the K loop, and reads them in the epilogue.

One CTA computes one (row tile, column block) pair. A row tile holds at most `block_m` rows
of a single expert (from `tile_schedule`, computed once per plan). A column block `j` holds
gate columns `[j*bn, (j+1)*bn)` and the matching up columns `n + [j*bn, (j+1)*bn)`, loaded
as two B tiles straight from the public `[E, d, 2n]` layout into two accumulators, so the
SwiGLU epilogue has both halves in registers without re-laying the weights.

The gather: Hopper's TMA has no row gather, so each of the `block_m` rows of an A stage is
its own `[1, block_k]` TMA copy `X[tok, k:k+bk] -> a_smem[slot, r]`, landing in the
128-byte-swizzled layout wgmma reads (through a (1, 64)-tiled view of the same SMEM, see
`_common.row_gather_buffers`). No gathered `[P, d]` copy of X is ever written. The source
tokens of a tile's rows come from `TileMeta.row_ids` (computed once per plan), staged in SMEM.

Two kernel structures, both warp-specialized: a producer warpgroup issues the copies and
C consumer warpgroups (`config.num_consumers`) run the wgmmas, through `num_stages` SMEM
slots.
- cooperative, one CTA per (row tile, column block) (`_warp_specialized_kernel`, the default
  for d > 4096 and, where 128 does not divide n, for d <= 1536; on the H100 for 1536 < d <=
  4096 until session 45, and where 128 does not divide n until session 48): the consumers
  either share each gathered stage and split the columns (C*block_n gate columns per CTA,
  so a row is gathered n / (C*block_n) times) or, with block_m = 64*C, split the rows and
  share the weight tiles. Measured on the H100: benchmarks/RESULTS.md.
- persistent (`config.pingpong_ctas`, `_pingpong_kernel`), the default for d <= 4096
  (`ForwardConfig.for_shape`). At d <= 1536 a ping-pong (an H200 takes split-M there from
  n = 512 on): the two consumers take alternate (64-row tile, `block_n` columns) items,
  each gathering its own rows, so one consumer's SwiGLU epilogue and stores run while the
  other's wgmmas keep the tensor cores busy. Above, split-M: every consumer takes every
  item, 64 rows each, so each weight tile feeds the whole item: 128 rows and two consumers,
  or, where 128 does not divide n, 192 rows, three consumers and 64 columns (gpt-oss:
  1.116x 128 rows on the H100, session 49). Same bits as the cooperative kernel. Split-M
  lost to the cooperative kernel at d = 7168 on the H100 (0.854x, session 48), so both
  stay.
(Session 22 removed a third, one-warpgroup kernel, in which the single warpgroup issued every
row copy and every wgmma: 3-4x slower, and no default used it. Session 58 removed
`prefetch_steps`, the persistent kernel's L2 prefetch of the gathered rows some K steps
ahead: 0.92-0.96x at 30B and level at 7B and gpt-oss on the H100, session 52;
`benchmarks/history/session58/up_prefetch.patch` restores it.)

Epilogue: the tile's real rows are TMA-stored with a power-of-two ladder (`store_rows`), so
a tile never writes rows of the next expert; empty tiles return before loading anything.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels._common import TileMeta
from pallas_moe.ops.activation import SwiGLU


@dataclasses.dataclass(frozen=True)
class UpProjConfig(_common.ClusterTiles):
    """Block sizes of the up-proj kernel.

    Attributes:
      block_m: rows per tile: 64, or 128 or 192 for the persistent kernel's split-M items
        (`pingpong_ctas`; `num_consumers = block_m // 64`).
      block_n: gate (and up) columns per CTA; the CTA computes 2*block_n columns of H.
        Must divide n and be a multiple of 64.
      block_k: contraction step; must divide d and be 64 (one 128-byte swizzle row of
        bf16). 32-wide steps in twice the stages measured 0.59-0.92x on the H100 and were
        removed (`docs/kernels.md`).
      num_stages: SMEM pipeline depth.
      num_consumers: C >= 1 consumer warpgroups beside one producer warpgroup (whose 4
        warps issue the row copies in parallel); they share each gathered A stage and own
        `block_n` gate + `block_n` up columns each, so a CTA covers `C * block_n` gate
        columns and every gathered row is loaded `n / (C * block_n)` times.
      no_auto_barriers: `plgpu.CompilerParams.unsafe_no_auto_barriers`.
      row_unroll: unroll factor of each producer warp's row-copy loop.
      gather: how the warp-specialized producer gathers X rows: "tma" (one `[1, 64]` TMA
        copy per row chunk; the only loader interpret mode can run) or "cp_async" (all 128
        producer threads issue 16-byte cp.async loads, `_common.cp_async_gather_rows`;
        compiled kernels only, one producer warpgroup, `num_stages >= 3`).
      gather_completion: with gather="cp_async", how a stage's rows are published:
        "mbarrier" (hardware-tracked, all stages in flight) or "wait_group" (the producer
        waits for its own loads `num_stages - 2` steps later); see `_common.GATHER_COMPLETIONS`.
      rebalance_registers: warp-specialized kernel only: the producers drop to 40
        registers per thread and the consumers take the rest (`_common.role_registers`);
        False keeps the even split (168 each with 2 consumers; the consumers then spill).
      approx_math: compiled kernels only: True (default) = the SwiGLU's sigmoid takes its
        exp from the hardware's `ex2.approx` (`plgpu.CompilerParams.approx_math`); False =
        the full-precision libdevice `exp`. Measured on the H100 (session 8): 701.6 ->
        679.8 us at 7B, 4383 -> 4297 us at 30B, with the same error against the reference
        (A 3.5e-3, bf16 rounding); a model's parity run (`train.parity`, session 10)
        matched the exact kernels to 7 digits. A differs from the xla backend's
        in the last bit of rare elements. It must equal `DHConfig.approx_math`, so the
        backward recomputes the same A (`KernelConfig` checks it). Interpret mode computes
        the exact exp either way.
      pingpong_ctas: 0 = one CTA per (row tile, column block). C > 0 (with two consumers
        and block_m = 64) = the ping-pong kernel (`_pingpong_kernel`): C persistent CTAs
        (e.g. the SM count) walk the (row tile, `block_n` gate columns) items, and each
        CTA's consumers take its items in turn, so one consumer's SwiGLU epilogue and
        stores run while the other's wgmmas keep the tensor cores busy. Each item's rows
        are gathered for it (a row is gathered `n / block_n` times, from L2 after the
        first). With block_m = 128 or 192 (split-M) the same persistent kernel gives every
        item to all `block_m // 64` consumers, 64 rows each, so each weight tile feeds
        `block_m` rows and the ring
        streams across items (the one-CTA-per-tile kernel drains and refills it per tile):
        the H200's default for 1536 < d <= 4096 (`ForwardConfig.for_shape`; session 24:
        1.10-1.27x the cooperative kernel at d = 2048-4096). Bitwise the same outputs as
        the cooperative kernel.
      fused_gate_up: each K step's gate and up weight tiles land side by side in one
        [block_k, 2 * block_n] SMEM tile and one wgmma of N = 2 * block_n multiplies it into
        one [64, 2 * block_n] accumulator per consumer (gate columns first), instead of two
        wgmmas of N = block_n that each re-read the A stage. Same products in the same K
        order per column, so bitwise the same outputs. Persistent kernel (ping-pong or
        split-M) only, and W1 interleaved per block_n only (`interleave_gate_up(w,
        block_n)`, `up_proj(gate_up_blocks=block_n)`): one [block_k, 2 * block_n] TMA box
        per step, 1.025-1.040x. (W1's halves layout took 16 eight-row boxes per step and
        measured 0.63x on an H200, removed in session 66.)
      cluster_m: 1 (default), or 2: split-M items run on clusters of two CTAs (the grid's
        `pingpong_ctas` CTAs, an even count, as pingpong_ctas / 2 clusters) that take two
        consecutive row blocks of one expert (`block_m` rows each, `tile_rows` = 2 *
        block_m rows of metadata per cluster item) and share each K step's weight tiles:
        every CTA asks for the whole tile with a cluster multicast copy, which the hardware
        splits (each CTA loads half and both receive all), so each weight byte read from L2
        feeds 2 * block_m rows. A slot is refilled once the consumers of both CTAs released
        it (`plgpu.ClusterBarrier`). Same products in the same order, so bitwise the same
        outputs. Interpret mode runs the same protocol with each CTA loading the whole tile
        (it has no multicast), so its tests check the barriers, not the multicast itself.
      wgmma_lag: 1 (default): a consumer releases a K step's slot once the next step's
        wgmmas are issued and its own are done, so it holds two slots and `num_stages - 2`
        load at a time. 0: it waits for each step's wgmmas and releases the slot at once,
        so `num_stages - 1` load while one is multiplied, at the price of the tensor cores
        idling between one step's end and the next one's issue (which the other consumer's
        wgmmas may fill). Why try it (session 51, the H100): 3 stages instead of 4 cost
        the 30B up-proj 0.878x and Qwen3-30B-A3B's 0.888x (one slot loading instead of
        two), a fifth stage does not fit in SMEM, and Nsight Compute had the producer and
        the consumers waiting on each other. Same products in the same order: bitwise the
        same outputs (checked on the H100). Measured level (session 52, paired): 0.998x at
        30B, 1.013x at Qwen3-30B-A3B's widths, so it stays opt-in.

    Each consumer of the persistent kernel stages one [64, 64] output tile (of A, H gate or
    H up) in SMEM at a time, waiting for its previous store to have read the buffer before
    it refills it, which leaves SMEM for 5 ping-pong stages. Session 63 removed
    `epilogue_tiles` (more staged tiles per consumer, 0 = all of the item's): on the H100
    (session 20, 7B) 3 tiles 692.8 us and 6 tiles 775.5 us against one tile's 610.1 us, on an
    H200 (session 24, 7B split-M) 4 tiles 592.3 against 569.4 us;
    `benchmarks/history/session63/up_proj_epilogue_tiles.patch` restores them.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    num_consumers: int = 1
    no_auto_barriers: bool = False
    row_unroll: int = 4
    gather: str = "tma"
    rebalance_registers: bool = True
    # Measured on the H100 (session 4, same run): the lagged publish 768 / 4386 us against
    # 800 / 4612 us with hardware-tracked stages at 7B / 30B.
    gather_completion: str = "wait_group"
    approx_math: bool = True
    pingpong_ctas: int = 0
    fused_gate_up: bool = False
    cluster_m: int = 1
    wgmma_lag: int = 1


def _check(x, w_gate_up, token_ids, config: UpProjConfig):
    d, n = _common.gate_up_widths(x, w_gate_up)
    _common.require_dtype("x", x, jnp.bfloat16)
    _common.require_dtype("w_gate_up", w_gate_up, jnp.bfloat16)
    if token_ids.ndim != 1:
        raise ValueError(f"plan.token_ids must be 1-D, got shape {tuple(token_ids.shape)}.")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    _common.require_multiple("config.block_m", bm, 64, "wgmma tiles rows by 64")
    _common.require_multiple("config.block_n", bn, 64, "output tiles are 128-byte swizzled")
    if bk != 64:
        raise ValueError(f"config.block_k={bk} must be 64 (one 128-byte swizzle row of bf16).")
    if config.num_stages < 2:
        raise ValueError(f"config.num_stages={config.num_stages} must be >= 2.")
    _common.require_multiple("d (x.shape[1])", d, bk, f"the K loop steps by block_k={bk}")
    if config.num_consumers < 1:
        raise ValueError(
            f"config.num_consumers={config.num_consumers} must be >= 1 (consumer warpgroups "
            "beside the producer)."
        )
    _check_pingpong(config)
    cols = _cta_cols(config)
    _common.require_multiple(
        "n (w_gate_up.shape[2] // 2)", n, cols,
        f"a CTA computes {cols} gate columns and the matching up columns",
    )
    _common.require_gather_mode(config)
    return d, n


def _check_pingpong(config: UpProjConfig) -> None:
    """The ping-pong kernel's own constraints (`pingpong_ctas`) and the fused gate and up
    wgmma's (`fused_gate_up`)."""
    if config.pingpong_ctas < 0:
        raise ValueError(f"config.pingpong_ctas={config.pingpong_ctas} must be >= 0.")
    if config.fused_gate_up and 2 * config.block_n > 256:
        raise ValueError(
            f"config.fused_gate_up=True needs 2 * block_n <= 256 (one wgmma's widest N), got "
            f"block_n={config.block_n}."
        )
    _common.require_cluster_m(config)
    _common.require_wgmma_lag(config)
    if config.cluster_m == 2 and (not _split_m(config) or config.pingpong_ctas % 2):
        raise ValueError(
            "config.cluster_m=2 (two CTAs sharing each weight tile) needs the persistent "
            "split-M kernel with an even CTA count: block_m=128 or 192 and pingpong_ctas a "
            f"positive even number, got block_m={config.block_m}, "
            f"pingpong_ctas={config.pingpong_ctas}."
        )
    if not config.pingpong_ctas:
        # One CTA per tile: 64-row tiles whose consumers split the columns. (Its split-M
        # form, 128-row tiles shared by two consumers, was removed in session 41: the
        # persistent split-M kernel replaced it, 1.10-1.27x faster on an H200, session 24.)
        if config.block_m != 64:
            raise ValueError(
                f"config.block_m={config.block_m} needs the persistent kernel: one CTA per tile "
                "takes block_m=64; set pingpong_ctas > 0 for 128-row split-M items."
            )
        if config.fused_gate_up:
            raise ValueError(
                "config.fused_gate_up=True needs the persistent kernel (pingpong_ctas > 0), or "
                "leave it False."
            )
        return
    if config.block_m == 64:
        ok = config.num_consumers == 2  # ping-pong: two consumers take alternate items
    else:  # split-M: every consumer takes 64 rows of every item
        ok = config.block_m in (128, 192) and config.num_consumers == config.block_m // 64
    if not ok:
        raise ValueError(
            "config.pingpong_ctas > 0 (the persistent kernel) needs block_m=64 with "
            "num_consumers=2 (ping-pong), or block_m=128 or 192 with num_consumers = "
            f"block_m // 64 (split-M), got num_consumers={config.num_consumers}, "
            f"block_m={config.block_m}."
        )


def up_proj(
    x: jax.Array,
    token_ids: jax.Array,
    group_sizes: jax.Array,
    w_gate_up: jax.Array,
    *,
    config: UpProjConfig = UpProjConfig(),
    inference: bool = False,
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: TileMeta | None = None,
    pad_a_rows_to: int = 1,
    bias: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
    gate_up_blocks: int = 0,
) -> tuple[jax.Array | None, jax.Array]:
    """Gathered grouped up-projection with fused SwiGLU.

    Args:
      x: bf16 [T, d] tokens.
      token_ids: i32 [P] source token of each grouped row (plan.token_ids).
      group_sizes: i32 [E] rows per expert (plan.group_sizes); rows past the sum are padding.
      w_gate_up: bf16 [E, d, 2n], gate = [..., :n], up = [..., n:].
      config: block sizes.
      inference: if True, only A is written (H is not needed without a backward).
      interpret: run in Mosaic GPU interpret mode (CPU) if True or an InterpretGPUParams.
      meta: precomputed `tile_meta(group_sizes, token_ids, config.tile_rows)`; computed here
        if None.
      pad_a_rows_to: A gets `P` rounded up to a multiple of this many rows (the down-proj
        loads whole aligned row blocks of A; padding here saves it a copy).
      bias: optional bf16 [E, 2n] expert bias (gate half first), added in fp32 before H is
        rounded.
      activation: the `SwiGLU` spec of the epilogue.
      gate_up_blocks: the column layout of `w_gate_up`. 0 (default): gate = [..., :n], up =
        [..., n:]. b > 0 (the persistent kernel or split-M tiles, b = config.block_n):
        interleaved blocks, columns [2 b j, 2 b j + b) are gate columns [b j, b j + b) and
        the next b their up columns, so an item's gate and up weights are one contiguous
        [block_k, 2 b] box per K step (`interleave_gate_up` builds it); the only layout
        `config.fused_gate_up` reads. H and the bias keep the halves layout.

    Returns:
      (h, a): h bf16 [P, 2n] (None if `inference`), a bf16 [P_a, n] with P_a = P rounded
      up to `pad_a_rows_to`. Padding rows are not written (their contents are unspecified).
    """
    d, n = _check(x, w_gate_up, token_ids, config)
    num_experts = w_gate_up.shape[0]
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    capacity = token_ids.shape[0]
    bm, bn = config.block_m, config.block_n
    if meta is None:
        meta = _common.tile_meta(group_sizes, token_ids, config.tile_rows)
    if meta.block_m != config.tile_rows:
        raise ValueError(
            f"meta.block_m={meta.block_m} must equal config.tile_rows={config.tile_rows} "
            f"(block_m={bm} times cluster_m={config.cluster_m})."
        )
    has_bias = bias is not None
    if has_bias:
        _common.require_dtype("bias", bias, jnp.bfloat16)
        _common.require_shape("bias", bias, (num_experts, 2 * n))
    dtype = x.dtype
    interpret_mode = _common.interpret_params(interpret)
    a_rows = -(-capacity // pad_a_rows_to) * pad_a_rows_to
    out_types = [jax.ShapeDtypeStruct((a_rows, n), dtype)]
    if not inference:
        out_types.insert(0, jax.ShapeDtypeStruct((capacity, 2 * n), dtype))
    params = dict(
        # The producer reads token ids from SMEM inside `warp_map`, and the bias is read with
        # an explicit layout (`_common.bias_columns`): both need the Lane lowering.
        lowering_semantics=plgpu.LoweringSemantics.Lane,
        unsafe_no_auto_barriers=config.no_auto_barriers,
        approx_math=config.approx_math,
    )
    args = (meta.expert, meta.row_start, meta.num_rows, meta.row_ids, x, w_gate_up)
    if has_bias:
        args += (bias,)
    if gate_up_blocks and (not config.pingpong_ctas or gate_up_blocks != bn):
        raise ValueError(
            f"gate_up_blocks={gate_up_blocks} (interleaved W1 columns) needs the persistent "
            f"kernel (config.pingpong_ctas > 0) and gate_up_blocks == config.block_n={bn}."
        )
    if config.fused_gate_up and not gate_up_blocks:
        # A fused [block_k, 2 * block_n] tile is one box of interleaved W1; from the halves
        # layout it took 2 * block_k / 8 eight-row boxes per step (0.63x, removed).
        raise ValueError(
            "config.fused_gate_up=True reads W1 interleaved per block_n, got "
            "gate_up_blocks=0 (the halves layout): interleave it with "
            f"interleave_gate_up(w, {bn}) and pass gate_up_blocks={bn}, or set "
            "fused_gate_up=False."
        )
    kernel_args = (config, d, n, meta.num_tiles, out_types, inference, interpret_mode, params,
                   has_bias, activation)
    if config.pingpong_ctas:
        # Real tiles come first in a TileMeta (empty ones only past the end), so the
        # kernel walks the first `real_tiles * grid_n` items.
        real_tiles = meta.real_tiles()
        outs = _pingpong_kernel(*kernel_args, interleaved=bool(gate_up_blocks))(
            real_tiles, *args)
    else:
        outs = _warp_specialized_kernel(*kernel_args)(*args)
    if inference:
        return None, outs[0]
    return outs[0], outs[1]


def _warp_specialized_kernel(
    config: UpProjConfig, d: int, n: int, num_tiles: int, out_types, inference: bool,
    interpret_mode, params, has_bias: bool = False, activation: SwiGLU = SwiGLU(),
):
    """The up-proj as one producer warpgroup + `config.num_consumers` consumer warpgroups.

    Producer (warpgroup C): stages the tile's token ids in SMEM, then for every K step waits
    until the consumers released the slot (`empty`), issues the `block_m` one-row copies of
    the gathered A stage from its 4 warps in parallel (`plgpu.warp_map`, `block_m / 4` rows
    each), and the two `[block_k, C * block_n]` weight tiles (gate and up columns), all
    arriving on `full[slot]`.
    Consumer c < C: waits `full[slot]`, issues wgmma on the shared A stage and its own
    `block_n` columns of each weight tile, and releases the slot once the wgmma of the next
    step is issued. After the K loop the consumers meet on a barrier (the pipeline buffers
    are reused as the epilogue's SMEM) and each writes its H and A columns through swizzled
    64-column slabs (`_common.row_tile_types`) that TMA stores row-exactly. With an expert
    bias each consumer first TMA-loads its own gate and up bias columns into SMEM of its
    own (outside the reused pipeline bytes).
    """
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    cons = config.num_consumers
    cols = _cta_cols(config)  # gate columns per CTA
    num_k = d // bk
    grid_n = n // cols
    dtype = jnp.bfloat16
    tf = _common.mma_transforms(dtype)
    num_out = 1 if inference else 3
    rows_per_warp = bm // 4
    interpret = interpret_mode is not None
    # Interpret mode cannot run cp.async: it runs the same kernel with the TMA row loader.
    cp_async = config.gather == "cp_async" and not interpret
    stage_bars = _common.uses_stage_mbarriers(config, interpret)

    def body(expert_ref, start_ref, rows_ref, ids_ref, x_ref, w_ref, *rest):
        b_ref, h_out, a_out, scratch = _body_refs(rest, has_bias, inference)
        ids_smem, bufs, full, empty, ids_bar, epi_bar, *extra = scratch
        # extra: the bias columns and their barrier (with biases), then the per-slot
        # cp.async mbarriers (hardware-tracked stages).
        bias_scratch, a_landed = (extra[:2], extra[2:]) if has_bias else ((), extra)
        a_copy, a_mma, (bg_smem, bu_smem), ((o_copy, o_mma),) = views(bufs)  # [stages, bk, C*bn]
        if stage_bars:  # a_landed[0]: per-slot mbarriers the cp.async loads complete
            _common.cp_async_stage_barriers_init(a_landed[0])
        wg = jax.lax.axis_index("wg")
        ni = jax.lax.axis_index("n")
        mi = jax.lax.axis_index("m")
        num_rows = rows_ref[mi]

        @pl.when((num_rows > 0) & (wg == cons))
        def _producer():
            if config.rebalance_registers:
                _common.role_registers("producer", cons)
            expert = expert_ref[mi]
            with jax.named_scope("ids"):
                plgpu.copy_gmem_to_smem(ids_ref.at[mi], ids_smem, ids_bar)
                plgpu.barrier_wait(ids_bar)
            w_e = w_ref.at[expert]  # [d, 2n]

            def step(ki, carry):
                slot = ki % stages
                k0 = ki * bk

                @pl.when(ki >= stages)
                def _():
                    plgpu.barrier_wait(empty.at[slot])

                def per_warp(w):
                    _common.gather_rows(  # [1, bk] of X[tok] per row
                        x_ref, ids_smem, [a_copy.at[slot]], full.at[slot],
                        col0=k0, width=bk, first_row=w * rows_per_warp,
                        num_rows=rows_per_warp, unroll=config.row_unroll,
                    )

                _copy_gate_up_weights(  # [bk, C*bn] gate and up columns
                    w_e, k0, bk, ni, cols, n, [bg_smem.at[slot], bu_smem.at[slot]],
                    full.at[slot], interleaved=False,
                )
                if cp_async:
                    _common.cp_async_gather_rows(  # [bm, bk] of X[tok], one cp.async group
                        x_ref.at[:, pl.ds(k0, bk)], ids_smem, [a_mma.at[slot]], num_rows=bm
                    )
                    _common.cp_async_publish(ki, full, a_landed, stages)
                else:
                    plgpu.warp_map(per_warp)
                return carry

            with jax.named_scope("loads"):
                jax.lax.fori_loop(0, num_k, step, None)
            with jax.named_scope("drain"):
                if cp_async:
                    _common.cp_async_publish_rest(num_k, full, a_landed, stages)
                # Observe the consumers' remaining releases (steps num_k-stages ..
                # num_k-2), so every barrier phase is consumed before exit (interpret
                # mode checks this).
                for g in range(max(num_k - stages, 0), num_k - 1):
                    plgpu.barrier_wait(empty.at[g % stages])

        for c in range(cons):
            @pl.when((num_rows > 0) & (wg == c))
            def _consumer(c=c):
                if config.rebalance_registers:
                    _common.role_registers("consumer", cons)
                row0 = start_ref[mi]
                csl = pl.ds(c * bn, bn)  # this consumer's columns of the weight tiles
                col = ni * cols + c * bn  # its first gate column
                if has_bias:  # this consumer's bias columns land while the K loop runs
                    bias_smem, bias_bars = bias_scratch
                    _start_bias_load(
                        b_ref, expert_ref[mi], col, bn, n, bias_smem.at[c], bias_bars.at[c]
                    )

                def wait(g, slot):
                    plgpu.barrier_wait(full.at[slot])
                    _common.cp_async_consumer_wait(g, a_landed, stages)

                def mma_scope(*accs):
                    _gate_up_k_loop(
                        accs, num_k, stages, 0, wait, empty,
                        lambda slot: a_mma.at[slot, slice(None)],  # [bm, bk], shared
                        # this consumer's columns of the [bk, C bn] gate and up tiles
                        lambda slot: (bg_smem.at[slot, :, csl], bu_smem.at[slot, :, csl]),
                        config.wgmma_lag,
                    )
                    return accs[0][...], accs[1][...]

                with jax.named_scope("k_loop"):
                    g, u = pl.run_scoped(
                        mma_scope, *(plgpu.ACC((bm, bn), jnp.float32) for _ in range(2))
                    )
                # Every consumer is done reading the pipeline buffers before any of them
                # overwrites them with its epilogue tile.
                with jax.named_scope("epilogue_sync"):
                    plgpu.barrier_arrive(epi_bar)
                    plgpu.barrier_wait(epi_bar)
                if has_bias:
                    biases = _bias_columns(bias_smem.at[c], bias_bars.at[c], bm)
                else:
                    biases = (None, None)
                dsts = [a_out.at[:, pl.ds(col, bn)]]
                if h_out is not None:
                    dsts += [h_out.at[:, pl.ds(col, bn)], h_out.at[:, pl.ds(n + col, bn)]]
                # One 64-column slab at a time: only a slab's temporaries are live next to
                # the two accumulators (the whole block at once spilled; session 5).
                slab = o_mma.shape[-1]  # columns of one slab
                with jax.named_scope("epilogue_math"):
                    for h0 in range(0, bn, slab):
                        cut = slice(h0, h0 + slab)
                        act, hg, hu = _common.swiglu_epilogue(  # [bm, slab] each
                            g[:, cut], u[:, cut], dtype, activation,
                            *(None if b is None else b[:, cut] for b in biases),
                        )
                        for t, tile in enumerate((act, hg, hu)[:num_out]):
                            _common.write_row_tile(o_mma.at[c, t], tile, first_slab=h0 // slab)
                    plgpu.commit_smem()
                with jax.named_scope("epilogue_store"):
                    for t, dst in enumerate(dsts):
                        _common.store_row_tile(o_copy.at[c, t], dst, row0, num_rows, bm)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    bufs, views = _common.gathered_pipeline_smem(
        (stages, bm, bk), dtype,
        others=[plgpu.SMEM((stages, bk, cols), dtype, transforms=tf)] * 2,  # gate, up
        # Per consumer: A, H gate, H up, as swizzled 64-column slabs (`row_tile_types`):
        # measured on the H100 (session 5, same run) 710 vs 764 us at 7B and 4345 vs 4512 us
        # at 30B against untiled rows, whose stores from the accumulator layout conflict.
        epilogue=[],
        row_tiles=[(cons, num_out, bm, bn)],
        interpret=interpret,
    )
    scratch = [
        plgpu.SMEM((bm,), jnp.int32),
        bufs,
        # full[slot]: the weight copies, plus what the row loader adds.
        plgpu.Barrier(
            num_arrivals=_common.gather_full_arrivals(config, bm, interpret)
            + _gate_up_weight_copies(fused=False),
            num_barriers=stages,
        ),
        plgpu.Barrier(num_arrivals=cons, num_barriers=stages),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=cons),
        *(_bias_scratch(bn, dtype, cons) if has_bias else ()),
        *([_common.cp_async_stage_barriers(stages)] if stage_bars else []),
    ]
    return plgpu.kernel(
        body,
        kernel_name="moe_up_proj",
        out_type=tuple(out_types),
        scratch_types=scratch,
        grid=(grid_n, num_tiles),
        grid_names=("n", "m"),
        num_threads=cons + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(**params),
        interpret=interpret_mode,
    )


def _pingpong_kernel(
    config: UpProjConfig, d: int, n: int, num_tiles: int, out_types, inference: bool,
    interpret_mode, params, has_bias: bool = False, activation: SwiGLU = SwiGLU(),
    interleaved: bool = False,
):
    """The up-proj as `config.pingpong_ctas` persistent CTAs: ping-pong or split-M.

    Work item w = (row tile w // grid_n, column block w % grid_n), grid_n = n / block_n:
    64 rows times `block_n` gate and `block_n` up columns. CTA i walks the items
    i, i + num_ctas, ... of the real tiles (the first `real_tiles[0] * grid_n`); its j-th
    item goes to consumer j % 2. Each consumer computes its item exactly as a consumer of
    the cooperative kernel computes its columns of a tile (same wgmmas in the same order,
    same epilogue), so the outputs are bitwise those of `_warp_specialized_kernel`.

    Pipeline: one ring of `num_stages` slots, each holding a gathered A stage [64, 64] and
    the item's gate and up weight tiles [64, block_n]. The producer issues every K step of
    every item back to back (global step g = j * num_k + ki uses slot g % stages), so the
    next item's rows and weights load while a consumer runs its epilogue. A step arrives on
    the `full` barrier of its item's consumer (`full[c * stages + slot]`: each consumer
    waits on every phase of its own barriers, which is how Pallas tracks phases), and the
    consumer that used a slot releases it on `empty[slot]`, which only the producer waits on.
    The producer stages the next item's token ids (double-buffered) while it loads this one.

    Epilogue: each consumer owns one swizzled [64, 64] row tile outside the ring. It
    computes the SwiGLU one 64-column slab at a time and TMA-stores the slab's A, H gate
    and H up tiles one after another through it; before it writes each tile it waits for
    its previous store to have read the buffer.

    Split-M (`block_m` = 128 or 192, `_split_m`): the same persistent walk over items of
    `block_m` rows, but all `block_m // 64` consumers take every item (below, "both" means
    all of them), consumer c multiplying rows [64 c, 64 c + 64) of each
    gathered stage by the stage's gate and up weight tiles (or, fused, its one [block_k,
    2 block_n] tile); so each weight tile serves 128 rows, and the producer streams the
    next item's stages while both consumers run their epilogues. (A one-CTA-per-tile form
    of these tiles, which drained and refilled its ring per tile, was 1.10-1.27x slower on
    an H200 and was removed in session 41.)
    One `full` barrier per slot, which both consumers wait on, and `empty` takes both
    consumers' releases.
    """
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    cons = config.num_consumers  # 2 in ping-pong; block_m / 64 in split-M
    split = _split_m(config)  # every consumer takes every item, 64 rows each
    rows_c = 64  # rows of one consumer's accumulator (the whole item unless split-M)
    sets = 1 if split else cons  # sets of `full` barriers: one per consumer in ping-pong
    num_k = d // bk
    grid_n = n // bn
    clusters = config.cluster_m  # CTAs per cluster, sharing each item's weight tiles
    # Walkers of the item list: CTAs, or clusters of `clusters` CTAs (`cluster_m`).
    num_ctas = min(config.pingpong_ctas // clusters, num_tiles * grid_n)
    multicast = _common.cluster_multicast(clusters)  # collective axis of the weight copies
    slab = _EPILOGUE_SLAB  # SwiGLU columns computed at a time (one swizzled slab)
    dtype = jnp.bfloat16
    tf = _common.mma_transforms(dtype)
    interpret = interpret_mode is not None
    cp_async = config.gather == "cp_async" and not interpret
    stage_bars = _common.uses_stage_mbarriers(config, interpret)
    fused = config.fused_gate_up
    smem = persistent_smem_bytes(config)
    if smem > _common.SMEM_BUDGET:  # the margin: ids, biases, barriers
        raise ValueError(
            f"the persistent up-proj needs {smem} B of SMEM for {stages} stages of [{bm}, {bk}] "
            f"rows + 2 x [{bk}, {bn}] weights and {cons} epilogue tiles of "
            f"[{rows_c}, {slab}], over the {_common.SMEM_BUDGET} B available: lower "
            "config.num_stages."
        )
    a_scratch, a_views = _common.row_gather_buffers(stages, bm, bk, dtype, interpret)
    o_scratch, o_views = _common.row_tile_buffers((cons, 1, rows_c, slab), dtype, interpret)

    def body(real_ref, expert_ref, start_ref, rows_ref, ids_ref, x_ref, w_ref, *rest):
        b_ref, h_out, a_out, scratch = _body_refs(rest, has_bias, inference)
        num_b = 1 if fused else 2
        a_bufs, b_bufs = scratch[0], scratch[1:1 + num_b]
        o_bufs, ids_smem, full, empty, ids_bar, *extra = scratch[1 + num_b:]
        bg_smem, bu_smem = (None, None) if fused else b_bufs  # [stages, bk, bn] each
        bias_scratch, a_landed = (extra[:2], extra[2:]) if has_bias else ((), extra)
        a_copy, a_mma = a_views(a_bufs)
        o_copy, o_mma = o_views(o_bufs)
        if stage_bars:
            _common.cp_async_stage_barriers_init(a_landed[0])
        wg = jax.lax.axis_index("wg")
        cta = jax.lax.axis_index("cta")  # the walker: a CTA, or a cluster of `clusters`
        # This CTA's row block of each (cluster) item: rows [half * bm, half * bm + bm).
        half = _common.cluster_rank(clusters)
        num_items = real_ref[0] * grid_n
        my_items = jnp.maximum(num_items - cta + num_ctas - 1, 0) // num_ctas

        def item(j):  # (row tile, column block) of this CTA's j-th item
            w = cta + j * num_ctas
            return w // grid_n, w % grid_n

        def full_of(step):  # the full barrier of global step `step`: its item's consumer's
            if split:  # (split-M: both consumers')
                return full.at[step % stages]
            return _common.pingpong_full_barrier(full, step, num_k, stages, cons)

        def load_ids(j):  # item j's source token ids (this CTA's rows) -> ids_smem[j % 2]
            mi, _ = item(j)
            ids = ids_ref.at[mi] if clusters == 1 else ids_ref.at[mi, pl.ds(half * bm, bm)]
            plgpu.copy_gmem_to_smem(ids, ids_smem.at[j % 2], ids_bar.at[j % 2])

        @pl.when(wg == cons)
        def _producer():
            if config.rebalance_registers:
                _common.role_registers("producer", cons)

            @pl.when(my_items > 0)
            def _():
                load_ids(0)

            def per_item(j, carry):
                mi, ni = item(j)
                has_next = j + 1 < my_items
                with jax.named_scope("ids"):
                    plgpu.barrier_wait(ids_bar.at[j % 2])
                    # Every producer thread is done reading item j - 1's ids before the
                    # next item's land in their buffer.
                    plgpu.commit_smem()

                    @pl.when(has_next)
                    def _():
                        load_ids(j + 1)

                ids = ids_smem.at[j % 2]
                w_e = w_ref.at[expert_ref[mi]]  # [d, 2n]

                def step(ki, carry):
                    g = j * num_k + ki
                    slot = g % stages
                    k0 = ki * bk

                    with jax.named_scope("empty_wait"):
                        @pl.when(g >= stages)
                        def _():
                            plgpu.barrier_wait(empty.at[slot])

                    bar = full_of(g)
                    with jax.named_scope("weights"):
                        _copy_gate_up_weights(w_e, k0, bk, ni, bn, n,
                                              [b.at[slot] for b in b_bufs], bar,
                                              interleaved=interleaved,
                                              collective_axes=multicast)
                    if cp_async:
                        with jax.named_scope("gather"):
                            _common.cp_async_gather_rows(  # [bm, bk] of X[tok], one group
                                x_ref.at[:, pl.ds(k0, bk)], ids, [a_mma.at[slot]], num_rows=bm
                            )
                        with jax.named_scope("publish"):  # waits for an older step's rows
                            _common.cp_async_publish(g, full_of, a_landed, stages)
                    else:
                        def per_warp(w):
                            _common.gather_rows(  # [1, bk] of X[tok] per row
                                x_ref, ids, [a_copy.at[slot]], bar, col0=k0, width=bk,
                                first_row=w * (bm // 4), num_rows=bm // 4,
                                unroll=config.row_unroll,
                            )

                        plgpu.warp_map(per_warp)
                    return carry

                with jax.named_scope("loads"):
                    jax.lax.fori_loop(0, num_k, step, None)
                return carry

            jax.lax.fori_loop(0, my_items, per_item, None)
            total = my_items * num_k  # steps issued
            with jax.named_scope("drain"):
                _common.pingpong_producer_drain(total, full_of, empty, a_landed, stages,
                                                cp_async)

        for c in range(cons):
            @pl.when(wg == c)
            def _consumer(c=c):
                if config.rebalance_registers:
                    _common.role_registers("consumer", cons)

                def per_item(jj, carry):
                    j = jj if split else c + cons * jj
                    mi, ni = item(j)
                    row0, count = start_ref[mi], rows_ref[mi]
                    if clusters > 1:  # this CTA's row block of the cluster item
                        row0, count = row0 + half * bm, jnp.clip(count - half * bm, 0, bm)
                    if split:  # this consumer's rows of the item: [c*64, c*64 + 64)
                        row0, count = row0 + c * rows_c, jnp.clip(count - c * rows_c, 0, rows_c)
                    col = ni * bn  # first gate column of the item
                    if has_bias:  # the item's bias columns land while the K loop runs
                        bias_smem, bias_bars = bias_scratch
                        _start_bias_load(
                            b_ref, expert_ref[mi], col, bn, n, bias_smem.at[c],
                            bias_bars.at[c],
                        )

                    def wait(g, slot):  # this consumer's full barrier of the slot
                        plgpu.barrier_wait(full.at[(0 if split else c) * stages + slot])
                        _common.cp_async_consumer_wait(g, a_landed, stages)

                    def mma_scope(*accs):
                        _gate_up_k_loop(
                            accs, num_k, stages, j * num_k, wait, empty,
                            # [64, bk]: the item's rows, or split-M this consumer's
                            (lambda slot: a_mma.at[slot, pl.ds(c * rows_c, rows_c)]) if split
                            else (lambda slot: a_mma.at[slot]),
                            # [bk, 2 bn] gate | up, or ([bk, bn] gate, [bk, bn] up)
                            lambda slot: ((b_bufs[0].at[slot],) if fused
                                          else (bg_smem.at[slot], bu_smem.at[slot])),
                            config.wgmma_lag,
                        )
                        # The last step's slot (ping-pong: the other consumer's item is next).
                        plgpu.barrier_arrive(empty.at[(j * num_k + num_k - 1) % stages])
                        if fused:
                            return accs[0][:, :bn], accs[0][:, bn:]
                        return accs[0][...], accs[1][...]

                    with jax.named_scope("k_loop"):
                        acc_shapes = [(rows_c, 2 * bn)] if fused else [(rows_c, bn)] * 2
                        g_acc, u_acc = pl.run_scoped(
                            mma_scope, *(plgpu.ACC(shape, jnp.float32) for shape in acc_shapes)
                        )
                    if has_bias:
                        biases = _bias_columns(bias_smem.at[c], bias_bars.at[c], rows_c)
                    else:
                        biases = (None, None)
                    outs = [a_out] if h_out is None else [a_out, h_out, h_out]
                    for h0 in range(0, bn, slab):
                        with jax.named_scope("epilogue_math"):
                            cut = slice(h0, h0 + slab)
                            tiles = _common.swiglu_epilogue(  # A, H gate, H up [bm, slab]
                                g_acc[:, cut], u_acc[:, cut], dtype, activation,
                                *(None if b is None else b[:, cut] for b in biases),
                            )
                        for t, dst in enumerate(outs):
                            with jax.named_scope("previous_store"):  # it has read the buffer
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            with jax.named_scope("epilogue_math"):
                                _common.write_row_tile(o_mma.at[c, 0], tiles[t])
                            c0 = col + h0 + (n if t == 2 else 0)  # H up: the second half
                            tile_dst = dst.at[:, pl.ds(c0, slab)]
                            with jax.named_scope("epilogue_store"):
                                plgpu.commit_smem()
                                _common.store_row_tile(o_copy.at[c, 0], tile_dst, row0, count,
                                                       rows_c)
                    return carry

                mine = my_items if split else (my_items - c + cons - 1) // cons
                jax.lax.fori_loop(0, mine, per_item, None)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [
        a_scratch,  # gathered X stages [stages, bm, bk]
        *([plgpu.SMEM((stages, bk, 2 * bn), dtype, transforms=tf)] if fused  # gate | up
          else [plgpu.SMEM((stages, bk, bn), dtype, transforms=tf)] * 2),  # gate, up stages
        o_scratch,  # per consumer: A, H gate, H up staging tiles
        plgpu.SMEM((2, bm), jnp.int32),  # token ids, double-buffered
        plgpu.Barrier(  # full, one set per consumer (split-M: one): weight copies + rows
            num_arrivals=_common.gather_full_arrivals(config, bm, interpret)
            + _gate_up_weight_copies(fused),
            num_barriers=sets * stages,
        ),
        # empty: the slot's consumer (split-M: every consumer; with clusters, every
        # consumer of every CTA of the cluster, whose multicast copies refill this slot)
        _common.cluster_barrier(clusters, num_arrivals=cons if split else 1,
                                num_barriers=stages),
        plgpu.Barrier(num_barriers=2),  # ids
        *(_bias_scratch(bn, dtype, cons) if has_bias else ()),
        *([_common.cp_async_stage_barriers(stages)] if stage_bars else []),
    ]
    return plgpu.kernel(
        body,
        kernel_name="moe_up_proj",
        out_type=tuple(out_types),
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        **_common.cluster_grid(clusters),
        num_threads=cons + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(**params),
        interpret=interpret_mode,
    )


def persistent_smem_bytes(config: UpProjConfig) -> int:
    """SMEM of the persistent kernel's ring (`num_stages` gathered [block_m, block_k] row
    stages and two [block_k, block_n] weight tiles each) and its consumers' epilogue tiles
    (one [64, 64] each), bf16. The kernel raises a ValueError above `_common.SMEM_BUDGET`."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    return (config.num_stages * (bm * bk + 2 * bk * bn)
            + config.num_consumers * 64 * _EPILOGUE_SLAB) * 2


_EPILOGUE_SLAB = 64  # columns of one swizzled [64, 64] epilogue tile


def _gate_up_weight_copies(fused: bool) -> int:
    """TMA copies `_copy_gate_up_weights` issues per K step (each one barrier arrival): one
    [bk, 2 cols] box fused, a gate and an up box otherwise."""
    return 1 if fused else 2


def _copy_gate_up_weights(w_e, k0, bk: int, block, cols: int, n: int, dsts, bar, *,
                          interleaved: bool, collective_axes: str | None = None) -> None:
    """TMA copies of the K step at row `k0` of W1[e] (`w_e` bf16 [d, 2n]): gate column block
    `block` (`cols` columns) and its up columns, into `dsts` = [[bk, cols] gate, [bk, cols]
    up] or, fused (`fused_gate_up`), [one [bk, 2 cols] tile, gate columns first], arriving
    on `bar`.

    W1's columns are the halves layout or interleaved per `cols` (`gate_up_blocks`); a fused
    tile needs the interleaved one, where the block's gate and up columns are one box.
    `collective_axes`: multicast each box to every CTA of the cluster (`cluster_m`)."""
    copy = functools.partial(plgpu.copy_gmem_to_smem, collective_axes=collective_axes)
    gate0, up0 = (2 * block * cols, 2 * block * cols + cols) if interleaved \
        else (block * cols, n + block * cols)
    if len(dsts) == 1:
        assert interleaved, "a fused tile reads interleaved W1 (up_proj checks it)"
        copy(w_e.at[pl.ds(k0, bk), pl.ds(gate0, 2 * cols)], dsts[0], bar)
        return
    for col0, dst in zip((gate0, up0), dsts, strict=True):
        copy(w_e.at[pl.ds(k0, bk), pl.ds(col0, cols)], dst, bar)


def interleave_gate_up(w_gate_up: jax.Array, block: int) -> jax.Array:
    """[E, d, 2n] halves layout (gate = [..., :n], up = [..., n:]) -> the interleaved layout
    `up_proj(gate_up_blocks=block)` reads: per `block` gate columns, then their up columns."""
    e, d, two_n = w_gate_up.shape
    n = two_n // 2
    _common.require_multiple("n (w_gate_up.shape[2] // 2)", n, block,
                             f"the columns interleave in blocks of {block}")
    halves = w_gate_up.reshape(e, d, 2, n // block, block)  # [E, d, gate|up, j, block]
    return halves.transpose(0, 1, 3, 2, 4).reshape(e, d, two_n)


def _body_refs(rest, has_bias: bool, inference: bool):
    """(bias ref or None, H out or None, A out, scratch refs) from a kernel body's refs
    after X and W1: the optional bias operand, the outputs (no H with `inference`), then
    the scratch."""
    b_ref, *rest = rest if has_bias else (None, *rest)
    if inference:
        a_out, *scratch = rest
        return b_ref, None, a_out, scratch
    h_out, a_out, *scratch = rest
    return b_ref, h_out, a_out, scratch


def _gate_up_k_loop(accs, num_k, stages: int, first_step, wait, empty, a_tile,
                    b_tiles, wgmma_lag: int) -> None:
    """A consumer's K loop (`_common.consumer_k_loop`) over its fp32 accumulators: (gate
    [rows, cols], up [rows, cols]), or one [rows, 2 * cols] of gate then up columns; step g
    multiplies `a_tile(slot)` [rows, bk] by the matching tile of `b_tiles(slot)` ([bk, cols]
    gate and up, or one [bk, 2 * cols]); `wgmma_lag` as `UpProjConfig.wgmma_lag`."""

    def mma(slot):
        a = a_tile(slot)
        for acc, b in zip(accs, b_tiles(slot), strict=True):
            plgpu.wgmma(acc, a, b)

    _common.consumer_k_loop(num_k, stages, wait, mma, empty, mmas_per_step=len(accs),
                            step_of=lambda ki: first_step + ki, wgmma_lag=wgmma_lag)


def _bias_scratch(cols: int, dtype, consumers: int | None = None) -> tuple:
    """SMEM of the gate and up bias columns ([2, cols], per consumer when `consumers` is
    given) and the barrier their two TMA copies arrive on (one per consumer)."""
    if consumers is None:
        return plgpu.SMEM((2, cols), dtype), plgpu.Barrier(num_arrivals=2)
    return (
        plgpu.SMEM((consumers, 2, cols), dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=consumers),
    )


def _start_bias_load(b_ref, expert, col0, cols: int, n: int, bias_smem, barrier) -> None:
    """TMA of expert `expert`'s gate bias columns `[col0, col0 + cols)` and the matching up
    columns `n + [col0, col0 + cols)` into `bias_smem` [2, cols], arriving on `barrier`."""
    b_e = b_ref.at[expert]  # [2n]
    plgpu.copy_gmem_to_smem(b_e.at[pl.ds(col0, cols)], bias_smem.at[0], barrier)
    plgpu.copy_gmem_to_smem(b_e.at[pl.ds(n + col0, cols)], bias_smem.at[1], barrier)


def _bias_columns(bias_smem, barrier, rows: int):
    """(gate bias, up bias) fp32 [rows, cols] once `_start_bias_load`'s copies landed."""
    plgpu.barrier_wait(barrier)
    return (
        _common.bias_columns(bias_smem.at[0], rows),
        _common.bias_columns(bias_smem.at[1], rows),
    )


def _split_m(config: UpProjConfig) -> bool:
    """The persistent kernel's consumers split each item's rows (64 each, `block_m` = 128
    or 192) and share the weight tiles, instead of taking alternate 64-row items."""
    return config.pingpong_ctas > 0 and config.block_m > 64


def _cta_cols(config: UpProjConfig) -> int:
    """Gate columns (and as many up columns) one CTA computes at a time: an item's in the
    persistent kernel, every consumer's `block_n` in the one-CTA-per-tile kernel."""
    if config.pingpong_ctas:
        return config.block_n
    return config.block_n * config.num_consumers
