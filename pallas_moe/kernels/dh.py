"""dH: the backward's first grouped GEMM, the mirror image of the up-proj.

    dA'[r] = dO[tok[r]] @ W2[e(r)]^T           f32 (the fused kernel: in registers only)
    A[r]   = act(H_g[r], H_u[r])               recomputed from the saved H (fp32)
    dH[r]  = act'(H_g[r], H_u[r], s[r] * dA'[r])   bf16 [P_pad, 2n]
    A'[r]  = s[r] * A[r]                       bf16 [P_pad, n]   (feeds dW2)
    dS[r]  = <dA'[r], A[r]>                    f32 [P]           (router-score gradient)

`act` is the `SwiGLU` spec (`silu(g) * u`: act' = [D * u * sig * (1 + g * (1 - sig)),
D * g * sig]; or gpt-oss's clamped variant, whose gradient is zero where a clamp is active),
computed by the spec's own `apply` / `grad_halves`, the formula of the `xla` backend. H is
the saved biased pre-activation, so the up-proj bias needs nothing here; the down-proj
bias's term of dS, `<dO[tok[r]], b2[e]>`, is added by `moe_backward` (`bias_grad`).

Two ways to compute them, chosen by `BackwardConfig.dh_gemm` (`for_shape`: the split with
dA' in bf16 at d >= 2048, where it measured 1.235x at 30B and 1.083x at d = 2048; the fused
kernel below, where it was 0.994x at 7B):
- `dh_kernel`, one fused kernel: dA' stays in registers and the dSwiGLU is its epilogue.
- `dh_split`, two kernels: the grouped GEMM's gathered mode writes dA' (bf16, or f32 with
  `BackwardConfig.dh_da_dtype`) with the up-proj's 128 x 256 items (no epilogue math beside
  their 128-register accumulators), then `dswiglu_rows` runs the same epilogue math per row
  at copy speed. With dA' in f32, dH and A' are the fused kernel's bits; in bf16, A' is.

The fused kernel, `_dh_persistent`: `DHConfig.persistent_ctas` persistent CTAs walk the work
items. An item is one (row tile, column block) pair, as in the up-proj: a row tile holds at
most `block_m` rows of one expert (`tile_meta`), a column block `j` holds columns
`[j*bn, (j+1)*bn)` of dA' and therefore gate columns `j*bn + [0, bn)` and up columns
`n + j*bn + [0, bn)` of H and dH. Each CTA is warp-specialized: a producer warpgroup issues
the gathered row copies from its 4 warps, and C consumer warpgroups
(`DHConfig.num_consumers`) share each gathered stage. The producer loads the next item's
token ids, scores and first K steps while the consumers run the epilogue.

The gather: each of the `block_m` rows of an A stage is its own `[1, block_k]` TMA copy
`dO[tok, k:k+bk] -> a_smem[slot, r]` (`row_gather_buffers`), or 16-byte cp.async loads
(`DHConfig.gather`); no gathered `[P, d]` copy of dO is ever written. B is
`W2[e][j*bn:(j+1)*bn, k:k+bk]` (`[bn, bk]`, K-minor), fed to wgmma transposed, so the public
`[E, n, d]` layout is read as is.

The epilogue tiles (H gate and up, overwritten with dH, and A') are 128-byte-swizzled
64-column slabs (`_common.row_tile_types`) overlaying the last W2 slots, so the accumulator
layout's SMEM reads and writes hit every bank once. After its K loop each consumer fills its
slabs with H by its own 16-byte cp.async loads (`h_loader="cp_async"`, the default of
`BackwardConfig.for_shape`; `_common.cp_async_load_rows`: rows past the tile zero-filled,
none read past the array) or by a row-exact ladder of TMA boxes per slab (`h_loader="tma"`,
`load_row_tile`: nothing past the tile's rows, nor past `P`, is read; interpret mode runs it
in place of cp.async, which it cannot run). The TMA boxes measured 0.92-0.95x of the cp.async
loads (benchmarks/RESULTS.md, sessions 19 and 21). dH and A' rows are TMA-stored row-exactly,
slab by slab. dS is reduced over the consumer's `bn` columns in registers and written as a
per-(tile, column block) partial `[num_tiles, grid_n, bm]` (each consumer owns its slot: no
atomics); `reduce_row_partials` sums the partials in a fixed order.

Removed forms, none a default and each measured slower (benchmarks/RESULTS.md): the
one-warpgroup kernel (session 22: 52 TF/s against 156 with 2 consumers at 7B on the H100);
in session 42 the ping-pong schedule (0.58x at 7B on an H200), the one-CTA-per-tile kernel
(`persistent_ctas=0`, with its `prefetch_h` and `early_h` H loads; on the H100 the persistent
kernel took 7B from 582.0 to 556.5 us in session 14, and with swizzled slabs 30B from 2848.7
to 2731.5 us in session 21) and the persistent kernel's untiled [bm, bn] epilogue tiles
(`epilogue_layout="untiled"`: 8-way bank conflicts, 0.81x of the swizzled slabs at 7B on an
H200, 538.9 against 437.7 us). Removed in session 48: session 46's split-M items (128-row
tiles whose two consumers each took 64 rows of every gathered stage and the whole W2 tile,
so each W2 byte filled into SMEM served 128 rows, with an epilogue streaming one 64-column
chunk of H at a time). They wrote the default's bits but ran at best 0.85x the default at
30B and 0.77x at 7B on the H100 (session 47): every such kernel spilled registers, the
[64, 256] f32 accumulator beside the dSwiGLU chunk. Removed in session 58: the producer's
L2 prefetch of each item's H rows (`h_prefetch_steps`, session 55), bitwise the default and
level with it on the H100 (session 56); `benchmarks/history/session58/dh_h_prefetch.patch`
restores it. Removed in session 59, after one H100 run each: session 57's ping-pong schedule
at SonicMoE's dH shape (the two consumers taking whole 128 x 128 items in turn, the dSwiGLU in
32-column pieces; the third ping-pong dH, after sessions 14 and 42), 0.44x the default at 7B
and 0.63x at 30B (0.47x / 0.65x with register stores), and the cooperative kernel's register
stores of dH and A' (`store="registers"`, predicated `st.global` from the accumulator layout,
H-only slabs), 0.70x at 7B and 0.84x at 30B. Both wrote the default's bits; ptxas spilled
436-772 B in each. `benchmarks/history/session59/dh_pingpong_registers.patch` restores them.
Removed in session 64: `DHConfig.wgmma_lag=0` (each slot released as soon as its own K
step's wgmma is done; bitwise the default), 0.994x at gpt-oss's widths on the H100 (session
64, 3 paired rounds, spread 1.4%; 0.955x / 0.959x at 30B in sessions 52 and 54, 1.033x once at
gpt-oss); `benchmarks/history/session64/dh_weight_grad_lag0.patch` restores it.
Removed in session 64: `DHConfig.gather_completion="mbarrier"` (the cp.async dO stages
completing on per-slot mbarriers, every stage in flight; bitwise the default), 1.001x at 7B
and 0.927x at 30B against the lagged publish on an H200 (session 39, 5 paired rounds; on
the H100 last measured in session 4, on the removed one-CTA-per-tile kernel);
`benchmarks/history/session64/dh_mbarrier_completion.patch` restores it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels._common import TileMeta
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig, grouped_matmul
from pallas_moe.ops.activation import SwiGLU


H_LOADERS = ("tma", "cp_async")


@dataclasses.dataclass(frozen=True)
class DHConfig:
    """Block sizes of the dH kernel (`_dh_persistent`).

    Attributes:
      block_m: rows per tile (a multiple of 64: one wgmma M=64 per 64 rows).
      block_n: columns of dA' per consumer (multiple of 64, at most 256); a consumer writes
        2*block_n columns of dH and block_n of A' per item.
      block_k: contraction step over d; must be 64 (one 128-byte swizzle row of bf16).
      num_stages: SMEM pipeline depth. The epilogue tiles overlay the last W2 slots and at
        least one slot must stay free (`_persistent_layout`): >= 4 at block_m=64, where the
        tiles overlay 3 slots whatever block_n and num_consumers. The stages must also
        fit the SMEM budget (ValueError naming the bytes otherwise).
      pad_rows_to: dH and A' get `P` rounded up to a multiple of this (the dX and weight-
        gradient kernels load whole aligned row blocks); padding rows are not written.
      num_consumers: C >= 1 consumer warpgroups beside the producer warpgroup (which issues
        the gathered row copies from its 4 warps); they share each gathered stage, each
        computing its own `block_n` columns (an item covers C * block_n columns, which must
        divide n).
      gather: how the producer gathers rows: "tma" (one `[1, 64]` TMA copy per row chunk;
        the loader interpret mode runs) or "cp_async" (16-byte cp.async loads from all 128
        producer threads, `_common.cp_async_gather_rows`; compiled kernels only, needs
        `num_stages >= 3`; interpret mode falls back to "tma"). A cp.async stage is
        published by the lagged `cp.async.wait_group` (`_common.cp_async_publish_lagged`):
        each producer thread waits for its own loads of step k at step k + num_stages - 2,
        fences them and arrives on the slot's `full` barrier, so `num_stages - 2` steps load
        at a time.
      rebalance_registers: the producer drops to 40 registers per thread and the consumers
        take the rest (`_common.role_registers`); False keeps the even split, where the
        dSwiGLU epilogue spills.
      epilogue_cols: the dSwiGLU epilogue runs in chunks of this many columns (a multiple of
        64, whole swizzled slabs, dividing block_n; 0 = the whole block at once), so only a
        chunk's temporaries are live next to the accumulator (the whole block at once spilled
        in the removed one-CTA-per-tile kernel: 908 vs 604 us at 7B, session 6).
      approx_math: compiled kernels only: True (default) = the dSwiGLU's sigmoid takes
        its exp from the hardware's `ex2.approx` (`plgpu.CompilerParams.approx_math`);
        False = the full-precision libdevice `exp`. Measured on the H100 (session 8): 623.6
        -> 581.0 us at 7B, 2927.6 -> 2888.6 us at 30B, same error against the reference.
        It must equal the forward's `UpProjConfig.approx_math` (or
        `DecodeConfig.approx_math`), so A' is recomputed from H as the forward computed A.
        Interpret mode computes the exact exp either way.
      persistent_ctas: the number of persistent CTAs (>= 1; at most one per item runs), e.g.
        the SM count (default 132, an H100's or H200's; `BackwardConfig.for_shape` sets the
        device's). CTA i walks the items i, i + C, ...; the outputs are bitwise the same for
        every C.
      h_loader: how H reaches the epilogue's swizzled slabs. "tma": a row-exact ladder of TMA
        boxes per slab (`load_row_tile`); "cp_async" (what `BackwardConfig.for_shape` sets):
        the consumer's own 128 threads issue 16-byte cp.async loads straight into the
        swizzled layout, rows past the tile's zero-filled (`_common.cp_async_load_rows`;
        compiled kernels only, interpret mode runs "tma").

    Removed in session 42 (a config naming them is a TypeError): `persistent_ctas=0` (one
    CTA per item) with its `prefetch_h` and `early_h`, and `epilogue_layout` (only the
    swizzled slabs remain); session 48 removed `split_m` and `epilogue_buffers` (the
    split-M items, slower on the H100); session 58 removed `h_prefetch_steps` (the
    producer's L2 prefetch of each item's H rows, level on the H100: 0.997x at 7B, 1.010x at
    30B in session 56); session 59 removed `schedule` (the ping-pong schedule) and `store`
    (register stores), both slower on the H100; see the module docstring. Session 62 removed
    `cluster_m` (items on clusters of two CTAs sharing each W2 tile by multicast: bitwise
    the default but 0.998x at 30B, 0.954x at 7B and 0.896x at gpt-oss on the H100, session
    51; since session 60 the split dH runs at 30B;
    `benchmarks/history/session62/dh_clusters.patch` restores it). Session 64 removed
    `wgmma_lag` (each consumer releases a K step's slot once the next step's wgmmas are
    issued and its own are done, `_common.consumer_k_loop`'s lag 1; see the module docstring)
    and `gather_completion` (cp.async stages on per-slot mbarriers; only the lagged publish
    remains, see `gather`).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    pad_rows_to: int = 64
    num_consumers: int = 1
    gather: str = "tma"
    rebalance_registers: bool = True
    epilogue_cols: int = 64
    approx_math: bool = True
    persistent_ctas: int = 132
    h_loader: str = "tma"

    @property
    def tile_rows(self) -> int:
        """Rows of one metadata tile (`TileMeta.block_m`): an item's `block_m` rows."""
        return self.block_m

    @property
    def gather_completion(self) -> str:
        """How cp.async stages are published: "wait_group" (the lagged publish), the only
        way since session 64. A property, not a field (naming it is a TypeError), so the
        shared gather helpers of `_common` read it as they read the other kernels' field."""
        return "wait_group"


def _check_operands(grad_out, h, w_down, token_ids, scores) -> tuple[int, int, int]:
    """(d, n, E) of dH's operands, their ranks, dtypes and shapes checked (errors name them)."""
    if grad_out.ndim != 2:
        raise ValueError(f"grad_out must be [T, d], got shape {tuple(grad_out.shape)}.")
    if w_down.ndim != 3:
        raise ValueError(f"w_down must be [E, n, d], got shape {tuple(w_down.shape)}.")
    if h.ndim != 2:
        raise ValueError(f"h must be [P, 2n], got shape {tuple(h.shape)}.")
    for name, arr in (("grad_out", grad_out), ("h", h), ("w_down", w_down)):
        _common.require_dtype(name, arr, jnp.bfloat16)
    _, d = grad_out.shape
    num_experts, n, d2 = w_down.shape
    if d2 != d:
        raise ValueError(f"w_down.shape[2]={d2} must equal grad_out.shape[1]={d}.")
    capacity = token_ids.shape[0]
    _common.require_shape("h", h, (capacity, 2 * n))
    _common.require_shape("scores", scores, (capacity,))
    return d, n, num_experts


def _check(grad_out, h, w_down, token_ids, scores, config: DHConfig):
    d, n, num_experts = _check_operands(grad_out, h, w_down, token_ids, scores)
    bn, bk = config.block_n, config.block_k
    _common.require_wgmma_blocks(config, "B tiles are 128-byte swizzled")
    if config.pad_rows_to < 1:
        raise ValueError(f"config.pad_rows_to={config.pad_rows_to} must be >= 1.")
    if config.num_consumers < 1:
        raise ValueError(
            f"config.num_consumers={config.num_consumers} must be >= 1 (consumer warpgroups "
            "beside the producer)."
        )
    if config.epilogue_cols and (config.epilogue_cols % 64 or bn % config.epilogue_cols):
        raise ValueError(
            f"config.epilogue_cols={config.epilogue_cols} must be 0 or a multiple of 64 "
            f"dividing block_n={bn}: the epilogue tiles are 64-column slabs."
        )
    _common.require_gather_mode(config)
    if config.persistent_ctas < 1:
        raise ValueError(
            f"config.persistent_ctas={config.persistent_ctas} must be >= 1: it is the number "
            "of persistent CTAs (e.g. the SM count; one CTA per item was removed in session 42)."
        )
    if config.h_loader not in H_LOADERS:
        raise ValueError(f"config.h_loader={config.h_loader!r} must be one of {H_LOADERS}.")
    _common.require_multiple("d (grad_out.shape[1])", d, bk, f"the K loop steps by block_k={bk}")
    cols = item_cols(config)
    _common.require_multiple("n (w_down.shape[1])", n, cols,
                             f"a CTA computes block_n * num_consumers = {cols} columns of dA'")
    return d, n, num_experts


def item_cols(config: DHConfig) -> int:
    """Columns of dA' one item covers (they must divide n): the consumers' `block_n` each."""
    return config.block_n * config.num_consumers


def item_coords(w, grid_n: int):
    """(row tile, column block) of work item `w` of the persistent dH: column blocks
    fastest, so the `grid_n` items of one row tile run at once on neighbouring CTAs and
    gather the same dO rows while L2 still holds them, as the up-proj's and the grouped
    GEMM's items do. With row tiles fastest (the order until session 59) each column block
    was a separate pass over every row tile, gathering all of dO again.

    Measured on the H100 (session 59, paired, bitwise the previous order): 1.061x at
    d = 1536, n = 1024, E = 32 (4 column blocks) and 1.074x at n = 512, E = 64 (2); level at
    30B (2 blocks, 1.006x; the training step too), Qwen3-30B-A3B (3, 0.998x) and
    gpt-oss-20b (15, 1.004x); the same walk at 7B (one block)."""
    return w // grid_n, w % grid_n


def ladder_len(max_rows: int) -> int:
    """Number of boxes (and barriers) `load_row_tile` uses for tiles of `max_rows` rows."""
    return max_rows.bit_length()


def tile_scores(scores: jax.Array, meta: TileMeta) -> jax.Array:
    """f32 [num_tiles, bm]: the score of each row slot of each tile, 0 past the tile's rows."""
    capacity = scores.shape[0]
    local = jnp.arange(meta.block_m, dtype=jnp.int32)[None, :]  # [1, bm]
    valid = local < meta.num_rows[:, None]  # [nt, bm]
    rows = jnp.clip(meta.row_start[:, None] + local, 0, capacity - 1)
    return jnp.where(valid, scores.astype(jnp.float32)[rows], 0.0)


def reduce_row_partials(partials: jax.Array, meta: TileMeta, capacity: int) -> jax.Array:
    """f32 [P]: `sum_j partials[t, j, i]` for row `row_start[t] + i` of each tile; 0 elsewhere.

    Deterministic: the column blocks are added in ascending order, and every row belongs to
    exactly one tile (the scatter has unique indices).
    """
    total = partials[:, 0]
    for j in range(1, partials.shape[1]):
        total = total + partials[:, j]  # [nt, bm]
    local = jnp.arange(meta.block_m, dtype=jnp.int32)[None, :]
    valid = local < meta.num_rows[:, None]
    rows = jnp.where(valid, meta.row_start[:, None] + local, capacity)
    out = jnp.zeros((capacity,), jnp.float32)
    return out.at[rows.reshape(-1)].set(jnp.where(valid, total, 0.0).reshape(-1), mode="drop")


def dswiglu_epilogue(da, g, u, s, activation: SwiGLU = SwiGLU()):
    """The dH epilogue on one [bm, bn] tile, all fp32 in registers.

    Args:
      da: dA' (the accumulator); g, u: H gate and up columns; s: scores broadcast to [bm, bn].
      activation: the forward's `SwiGLU` spec.

    Returns:
      (d gate, d up, A' = s * A, dS partial [bm] = sum over the tile's columns of dA' * A).
      The split dH's row pass (`dswiglu_rows`) calls it on one row ([n] arrays, s a
      scalar): the same operations in the same order, so the same dH and A' bits.
    """
    act = activation.apply(g, u)
    d_gate, d_up = activation.grad_halves(g, u, s * da)
    return d_gate, d_up, s * act, jnp.sum(da * act, axis=1 if da.ndim == 2 else None)


def _dswiglu_and_store(da, s_smem, hg_tile, hu_tile, ap_tile, ds_ref, dh_out, ap_out, ds_dst,
                       c0, n: int, row0, num_rows, bm: int, ep_cols: int, activation: SwiGLU):
    """A consumer's epilogue, once its H tile is in SMEM: dSwiGLU in column chunks, then the
    row-exact TMA stores of dH and A' and the copy of its dS partial.

    Args:
      da: f32 [bm, bn] accumulator (dA' of the consumer's `bn` columns, from column c0).
      s_smem: f32 [bm] scores of the tile's rows; ds_ref: f32 [bm].
      hg_tile, hu_tile: the H gate and up columns, overwritten with dH; ap_tile: the A' tile.
        Each is a `_common.row_tile_types` pair (copy view, wgmma view) of [bn / 64, bm, 64]
        bf16 128-byte-swizzled slabs, whose register reads and writes are free of bank
        conflicts. `ep_cols` must be a multiple of 64 (whole slabs).
      dh_out, ap_out: the GMEM outputs bf16 [P_pad, 2n] and [P_pad, n]; ds_dst: f32 [bm] slot
        of the dS partials.

    Returns once the SMEM tiles may be reused (once the TMA stores have read them).
    """
    layout = plgpu.Layout.WGMMA
    slab = hg_tile[1].shape[-1]
    bn = hg_tile[1].shape[-3] * slab
    dtype = hg_tile[1].dtype
    assert ep_cols % slab == 0, (ep_cols, slab)

    def read(tile, q):  # [bm, ep_cols] of chunk q, wgmma layout
        first = q * ep_cols // slab
        return jnp.concatenate(
            [tile[1][h] for h in range(first, first + ep_cols // slab)], axis=1)

    def write(tile, q, value):
        _common.write_row_tile(tile[1], value, first_slab=q * ep_cols // slab)

    def store(tile, dst):
        _common.store_row_tile(tile[0], dst, row0, num_rows, bm)

    s = plgpu.load(s_smem, layout=layout.reduce(1))  # [bm] f32
    s = jax.lax.broadcast_in_dim(s, (bm, ep_cols), [0])
    ds = None
    # In column chunks: only a chunk's H, temporaries and results are live next to the
    # accumulator (the whole tile at once spills).
    with jax.named_scope("dswiglu"):
        for q in range(bn // ep_cols):
            g, u = read(hg_tile, q), read(hu_tile, q)
            d_gate, d_up, a_scaled, ds_q = dswiglu_epilogue(
                da[:, q * ep_cols:(q + 1) * ep_cols], g.astype(jnp.float32),
                u.astype(jnp.float32), s, activation,
            )
            ds = ds_q if ds is None else ds + ds_q
            for tile, value in zip((hg_tile, hu_tile, ap_tile), (d_gate, d_up, a_scaled)):
                write(tile, q, value.astype(dtype))
        ds_ref[...] = ds
        plgpu.commit_smem()
    with jax.named_scope("store"):
        store(hg_tile, dh_out.at[:, pl.ds(c0, bn)])
        store(hu_tile, dh_out.at[:, pl.ds(n + c0, bn)])
        store(ap_tile, ap_out.at[:, pl.ds(c0, bn)])
        plgpu.copy_smem_to_gmem(ds_ref, ds_dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def load_row_tile(src_gmem, copy_view, row0, num_rows, max_rows: int, bars, issue: bool,
                  bar0=0):
    """TMA-loads rows `[row0, row0 + num_rows)` of `src_gmem` (bf16 [P, slabs * w]) into rows
    `[0, num_rows)` of a `_common.row_tile_types` tile (copy view [slabs, max_rows, w]): slab
    h gets `src_gmem[row0 + i, w h : w (h + 1)]`, as a power-of-two ladder of boxes (the
    mirror of `_common.store_rows`). Rows past `num_rows`, and past `P`, are not touched.

    Box `i` (height `2**i`) of every slab arrives on `bars.at[bar0 + i]`, so each barrier
    counts `slabs` arrivals per tile (a static count). With `issue=True` this starts the
    copies; with `issue=False` it waits on the barriers of the boxes once (one wait covers
    every tile issued with the same `bars`, row0 and num_rows, if the barriers count that
    many arrivals).
    """
    slabs, w = copy_view.shape[-3], copy_view.shape[-1]
    for h in range(slabs if issue else 1):
        src, dst = src_gmem.at[:, pl.ds(h * w, w)], copy_view.at[h]
        start = 0  # a Python int until the first dynamic step (Mosaic wants Values or ints)
        size = 1 << (max_rows.bit_length() - 1)
        i = 0
        while size >= 1:
            this, bar = size, bars.at[bar0 + i]

            @pl.when((num_rows & this) != 0)
            def _():
                if issue:
                    plgpu.copy_gmem_to_smem(
                        src.at[pl.ds(row0 + start, this)], dst.at[pl.ds(start, this)], bar
                    )
                else:
                    plgpu.barrier_wait(bar)

            start = start + (num_rows & this)
            size //= 2
            i += 1


def dh_kernel(
    grad_out: jax.Array,
    h: jax.Array,
    token_ids: jax.Array,
    group_sizes: jax.Array,
    scores: jax.Array,
    w_down: jax.Array,
    *,
    config: DHConfig = DHConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: TileMeta | None = None,
    activation: SwiGLU = SwiGLU(),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dH, A' and dS from the saved H, with the gather of dO fused into the load.

    Args:
      grad_out: bf16 [T, d] cotangent of the layer output (dO).
      h: bf16 [P, 2n] saved up-proj output; padding rows are never read.
      token_ids: i32 [P] source token of each grouped row (plan.token_ids).
      group_sizes: i32 [E] rows per expert (plan.group_sizes).
      scores: f32 [P] router weight of each row (plan.scores).
      w_down: bf16 [E, n, d].
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode (CPU) if True or an InterpretGPUParams.
      meta: precomputed `tile_meta(group_sizes, token_ids, config.tile_rows)`.
      activation: the forward's `SwiGLU` spec.

    Returns:
      (dh bf16 [P_pad, 2n], a_scaled bf16 [P_pad, n], d_scores f32 [P]) with P_pad = P
      rounded up to `config.pad_rows_to`. Rows of dh and a_scaled past `sum(group_sizes)`
      are not written (unspecified); d_scores is 0 there.
    """
    d, n, num_experts = _check(grad_out, h, w_down, token_ids, scores, config)
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    capacity = token_ids.shape[0]
    bn, tm = config.block_n, config.tile_rows
    if meta is None:
        meta = _common.tile_meta(group_sizes, token_ids, tm)
    if meta.block_m != tm:
        raise ValueError(f"meta.block_m={meta.block_m} must equal config.block_m={tm}.")
    num_tiles = meta.num_tiles
    grid_n = n // bn
    dtype = grad_out.dtype
    s_tiles = tile_scores(scores, meta)  # [nt, tm]
    rows_pad = -(-capacity // config.pad_rows_to) * config.pad_rows_to
    out_types = (
        jax.ShapeDtypeStruct((rows_pad, 2 * n), dtype),  # dH
        jax.ShapeDtypeStruct((rows_pad, n), dtype),  # A'
        jax.ShapeDtypeStruct((num_tiles, grid_n, tm), jnp.float32),  # dS partials
    )
    interpret_mode = _common.interpret_params(interpret)
    args = (meta.expert, meta.row_start, meta.num_rows, meta.row_ids, s_tiles, grad_out, w_down, h)
    kernel = _dh_persistent(config, d, n, num_tiles, out_types, interpret_mode, activation)
    dh, a_scaled, ds_part = kernel(*args)
    return dh, a_scaled, reduce_row_partials(ds_part, meta, capacity)


# The split dH's row pass: rows per CTA, each loaded before any is computed, so a CTA keeps
# this many rows' loads in flight (2, 4 and 8 measured level on the H100, session 60).
DSWIGLU_ROWS_PER_CTA = 4
# dA' between the split dH's two kernels (`dh_split(da_dtype=...)`).
DA_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def dswiglu_rows(
    da: jax.Array,
    h: jax.Array,
    scores: jax.Array,
    num_rows: jax.Array,
    *,
    out_rows: int,
    approx_math: bool = True,
    activation: SwiGLU = SwiGLU(),
    rows_per_cta: int = DSWIGLU_ROWS_PER_CTA,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The split dH's second kernel: the dSwiGLU of each row from a dA' computed before.

        dH[r] = act'(H_g[r], H_u[r], s[r] * dA'[r]);  A'[r] = s[r] * A[r];  dS[r] = <dA'[r], A[r]>

    (dA' in bf16 is widened to f32 as it is loaded; the math is the same.)

    A memory-bound pass (no SMEM, no barriers but dS's reduction): one warpgroup per
    `rows_per_cta` rows, each row's dA', H gate and H up loaded straight from HBM into a
    strided register layout (16-byte f32 loads where 512 divides n), the math of the fused
    kernel's epilogue (`dswiglu_epilogue`, so dH and A' are its bits for the same dA'), the
    results stored from registers. dS sums the whole row (a warpgroup reduction).

    Args:
      da: f32 or bf16 [P_a, n], P_a >= P: dA' = dO[tok] @ W2[e]^T (unscaled), grouped
        row order.
      h: bf16 [P, 2n] saved up-proj output (gate columns first).
      scores: f32 [P] router weight of each row.
      num_rows: i32 [1]: rows [0, num_rows) are real (`sum(group_sizes)`); the others'
        dA' and H are never trusted (read, then dropped).
      out_rows: rows of the dh and a_scaled outputs (>= P; the padded capacity).
      approx_math: the sigmoid's exp from `ex2.approx` (compiled kernels), as the forward.
      activation: the forward's `SwiGLU` spec.
      rows_per_cta: rows one CTA loads, then computes (unrolled).
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.

    Returns:
      (dh bf16 [out_rows, 2n], a_scaled bf16 [out_rows, n], d_scores f32 [P]). Rows of dh
      and a_scaled from num_rows on are not written (unspecified); d_scores is 0 there.
    """
    if da.ndim != 2 or h.ndim != 2:
        raise ValueError(f"da and h must be 2-D, got shapes {tuple(da.shape)}, {tuple(h.shape)}.")
    if da.dtype not in DA_DTYPES:
        raise TypeError(f"da must have dtype float32 or bfloat16, got {da.dtype}.")
    _common.require_dtype("h", h, jnp.bfloat16)
    _common.require_dtype("scores", scores, jnp.float32)
    capacity = scores.shape[0]
    n = da.shape[1]
    _common.require_shape("h", h, (capacity, 2 * n))
    _common.require_shape("num_rows", num_rows, (1,))
    if da.shape[0] < capacity:
        raise ValueError(f"da.shape[0]={da.shape[0]} must be >= scores.shape[0]={capacity}.")
    if out_rows < capacity:
        raise ValueError(f"out_rows={out_rows} must be >= scores.shape[0]={capacity}.")
    _common.require_multiple("n (da.shape[1])", n, 128,
                             "each of a warpgroup's 128 threads holds whole vectors of a row")
    if rows_per_cta < 1:
        raise ValueError(f"rows_per_cta={rows_per_cta} must be >= 1.")
    vec = next(v for v in (4, 2, 1) if n % (128 * v) == 0)
    layout = plgpu.Layout.WG_STRIDED((n,), vec_size=vec)
    br = rows_per_cta
    dtype = h.dtype

    def body(count_ref, s_ref, da_ref, h_ref, dh_ref, ap_ref, ds_ref):
        first = jax.lax.axis_index("r") * br
        count = jnp.minimum(count_ref[0], capacity)  # never a row past P, whatever it says
        loaded = []
        for i in range(br):  # every row's loads first: br rows in flight per warpgroup
            src = jnp.minimum(first + i, capacity - 1)  # past P: a row read and dropped
            loaded.append((
                plgpu.load(da_ref.at[src, pl.ds(0, n)], layout=layout),
                plgpu.load(h_ref.at[src, pl.ds(0, n)], layout=layout),
                plgpu.load(h_ref.at[src, pl.ds(n, n)], layout=layout),
                s_ref[src],
            ))
        for i, (da_r, g, u, s) in enumerate(loaded):
            r = first + i
            if da_r.dtype != jnp.float32:
                da_r = da_r.astype(jnp.float32)
            d_gate, d_up, a_scaled, ds = dswiglu_epilogue(
                da_r, g.astype(jnp.float32), u.astype(jnp.float32), s, activation)

            @pl.when(r < count)
            def _():
                dh_ref[r, pl.ds(0, n)] = d_gate.astype(dtype)
                dh_ref[r, pl.ds(n, n)] = d_up.astype(dtype)
                ap_ref[r, pl.ds(0, n)] = a_scaled.astype(dtype)
                ds_ref[r] = ds

            @pl.when((r >= count) & (r < capacity))
            def _():
                ds_ref[r] = jnp.float32(0.0)

    kernel = plgpu.kernel(
        body,
        kernel_name="moe_dh_rows",
        out_type=(
            jax.ShapeDtypeStruct((out_rows, 2 * n), dtype),
            jax.ShapeDtypeStruct((out_rows, n), dtype),
            jax.ShapeDtypeStruct((capacity,), jnp.float32),
        ),
        grid=(pl.cdiv(capacity, br),),
        grid_names=("r",),
        compiler_params=plgpu.CompilerParams(approx_math=approx_math),
        interpret=_common.interpret_params(interpret),
    )
    return kernel(num_rows.astype(jnp.int32), scores, da, h)


def dh_split(
    grad_out: jax.Array,
    h: jax.Array,
    token_ids: jax.Array,
    group_sizes: jax.Array,
    scores: jax.Array,
    w_down: jax.Array,
    *,
    gemm: GroupedMatmulConfig,
    pad_rows_to: int = 64,
    approx_math: bool = True,
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: TileMeta | None = None,
    activation: SwiGLU = SwiGLU(),
    da_dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dH, A' and dS as two kernels: the grouped GEMM, then the dSwiGLU row pass.

        dA' = dO[tok] @ W2[e]^T    f32 [P, n]: `grouped_matmul`'s gathered mode (cp.async
                                   or one-row TMA copies), 128-row items, no epilogue math
        dH, A', dS = dswiglu_rows(dA', H, s)

    The fused kernel (`dh_kernel`) keeps dA' in registers, so its 64-row items keep each
    consumer's accumulator small enough for the dSwiGLU beside it; the GEMM here runs the
    up-proj's 128 x 256 items instead (each W2 byte staged in SMEM feeds 128 rows), at the
    price of writing dA' and reading it back. `BackwardConfig.for_shape` picks it, with dA'
    in bf16, where that measured faster (benchmarks/RESULTS.md, sessions 60 and 63). In
    f32, dA' is the fused kernel's accumulator bit for bit (the same K order per output
    element), so dH and A' are the fused kernel's bits; dS sums each row in another order
    (f32 rounding apart).
    With `da_dtype=bfloat16` the GEMM rounds dA' to bf16 (half the bytes written and read
    back): A' keeps its bits, dH and dS are those of the rounded dA' (one more bf16
    rounding than the fused kernel's dH, which rounds only its output).

    Args:
      grad_out, h, token_ids, group_sizes, scores, w_down: as `dh_kernel`.
      gemm: the GEMM's blocks (split-M items, no pingpong: the gathered mode).
      pad_rows_to: dH and A' get P rounded up to a multiple of this (as `DHConfig`).
      approx_math: the row pass's sigmoid from `ex2.approx` (as the forward's).
      interpret: run in Mosaic GPU interpret mode (CPU) if True or an InterpretGPUParams.
      meta: precomputed `aligned_tile_meta(group_sizes, P, gemm.tile_rows)`.
      activation: the forward's `SwiGLU` spec.
      da_dtype: dA' between the two kernels, float32 (default) or bfloat16.

    Returns:
      As `dh_kernel`: (dh bf16 [P_pad, 2n], a_scaled bf16 [P_pad, n], d_scores f32 [P]).
    """
    if jnp.dtype(da_dtype) not in DA_DTYPES:
        raise TypeError(f"da_dtype must be float32 or bfloat16, got {jnp.dtype(da_dtype).name}.")
    _, n, num_experts = _check_operands(grad_out, h, w_down, token_ids, scores)
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    if pad_rows_to < 1:
        raise ValueError(f"pad_rows_to={pad_rows_to} must be >= 1.")
    capacity = token_ids.shape[0]
    da = grouped_matmul(
        grad_out, group_sizes, w_down, transpose_w=True, config=gemm, interpret=interpret,
        meta=meta, capacity=capacity, names=("grad_out", "w_down"), kernel_name="moe_dh_gemm",
        out_dtype=da_dtype, token_ids=token_ids,
    )
    num_rows = jnp.sum(group_sizes, dtype=jnp.int32).reshape(1)
    rows_pad = -(-capacity // pad_rows_to) * pad_rows_to
    return dswiglu_rows(da, h, scores, num_rows, out_rows=rows_pad, approx_math=approx_math,
                        activation=activation, interpret=interpret)


def _issue_k_step(do_ref, ids, w_e, col0, cols: int, k0, bk: int, a_copy, a_mma, b_slot,
                  full_bar, cp_async: bool) -> None:
    """Producer warpgroup, one K step of an item: the `[cols, bk]` W2
    tile `w_e[col0:col0+cols, k0:k0+bk]` (K-minor) and the gathered dO rows
    `dO[ids[r], k0:k0+bk]` of the slot, arriving on `full_bar`. With cp.async the rows are
    one cp.async group the caller publishes (`_common.cp_async_publish_lagged`); otherwise each of
    the 4 warps issues a quarter of the one-row TMA copies (the loader interpret mode runs).
    """
    plgpu.copy_gmem_to_smem(w_e.at[pl.ds(col0, cols), pl.ds(k0, bk)], b_slot, full_bar)
    bm = a_mma.shape[0]
    if cp_async:
        _common.cp_async_gather_rows(do_ref.at[:, pl.ds(k0, bk)], ids, [a_mma], num_rows=bm)
        return
    rows_per_warp = bm // 4

    def per_warp(w):
        _common.gather_rows(  # [1, bk] of dO[tok] per row
            do_ref, ids, [a_copy], full_bar, col0=k0, width=bk,
            first_row=w * rows_per_warp, num_rows=rows_per_warp, unroll=4,
        )

    plgpu.warp_map(per_warp)


def _persistent_epilogue_types(config: DHConfig):
    """The epilogue tiles, per consumer, bf16, as ((A' copy view, wgmma view), (H copy view,
    wgmma view)): the `_common.row_tile_types` pairs of 128-byte-swizzled 64-column slabs.

    Whole tiles: A' [bm, bn] and H gate / up [2, bm, bn] (overwritten with dH).
    Measured on the H100 (session 19, `benchmarks/timeline.py`): with the removed untiled
    [bm, bn] tiles the epilogue's SMEM reads and writes (8-way bank conflicts) took ~4.7 of
    its ~7.5 us per 7B item."""
    cons, bm, bn = config.num_consumers, config.block_m, config.block_n
    return (_common.row_tile_types((cons, bm, bn), jnp.bfloat16),
            _common.row_tile_types((cons, 2, bm, bn), jnp.bfloat16))


def _persistent_layout(config: DHConfig):
    """(overlaid, W2 slot bytes, epilogue bytes) of the kernel's SMEM: the epilogue's A' and
    H tiles overlay the last `overlaid` W2 slots, so the next item's first
    `stages - overlaid` steps can load while the consumers run the epilogue."""
    slot_bytes = item_cols(config) * config.block_k * 2
    ap_views, h_views = _persistent_epilogue_types(config)
    epilogue_bytes = _common.group_spans([ap_views[-1], h_views[-1]])[-1][1]
    return -(-epilogue_bytes // slot_bytes), slot_bytes, epilogue_bytes


def _dh_persistent(config: DHConfig, d: int, n: int, num_tiles: int, out_types,
                   interpret_mode, activation: SwiGLU = SwiGLU()):
    """The dH kernel: `config.persistent_ctas` persistent CTAs of one producer warpgroup and
    `config.num_consumers` consumer warpgroups.

    CTA `i` walks the work items `i, i + num_ctas, ...` (item = (row tile, column block),
    column blocks fastest: `item_coords`). Every item is computed the same way whichever CTA takes it (the same
    wgmmas in the same order, one 64-wide K step each, the same epilogue), so the outputs
    are bitwise the same for every CTA count. What persistence buys: the producer runs ahead
    into the next item (its token ids, scores and first K steps) while the consumers run the
    epilogue, and no CTA is relaunched per tile.

    Producer (warpgroup C): per item, stages the tile's token ids and scores in SMEM, then
    for every K step waits until the consumers released the slot (`empty`), issues the
    `block_m` gathered dO rows of the stage (`_issue_k_step`) and the `[C * block_n,
    block_k]` W2 tile, arriving on `full[slot]`. Consumer c < C: waits `full[slot]`, issues
    wgmma on the shared dO stage and its own `block_n` rows of the W2 tile, and releases
    the slot once the next step's wgmma is issued; after the K loop it loads its H gate and
    up columns into its swizzled slabs and runs the epilogue (`_dswiglu_and_store`), in
    chunks of `config.epilogue_cols` columns.

    Pipeline: every item's K loop starts at slot 0 (`slot = ki % stages`). The epilogue's A'
    and H tiles overlay the last `overlaid` W2 slots (`_persistent_layout`); the gathered dO
    slots and the first W2 slots stay free, so the producer may fill the next item's steps
    `[0, stages - overlaid)` at once, and waits for the consumers' `epi_done` (their stores
    have read the tiles) before its first overlaid slot, or before the last step of an item
    with no more steps than free slots (so the consumers never complete `epi_done`'s next
    phase before the producer observed the previous one). Every slot use is released by the
    consumers, and the producer waits for the release of a slot's previous use (across
    items), then observes the last ones before exit. Token ids and scores are
    double-buffered by the parity of the CTA's count of non-empty items. With cp.async the
    producer publishes each step `stages - 2` steps later, and an item's last steps at its
    end (a short stall while the consumers still have the item's last steps to compute).
    """
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    cons = config.num_consumers
    cols = item_cols(config)
    ep_cols = config.epilogue_cols or bn
    num_k = d // bk
    grid_n = n // cols
    num_items = num_tiles * grid_n
    num_ctas = min(config.persistent_ctas, num_items)
    dtype = jnp.bfloat16
    num_ladder = ladder_len(bm)
    interpret = interpret_mode is not None
    cp_async = config.gather == "cp_async" and not interpret
    h_cp_async = config.h_loader == "cp_async" and not interpret
    overlaid, slot_bytes, epilogue_bytes = _persistent_layout(config)
    free = stages - overlaid  # W2 slots the epilogue leaves alone
    # The K step before which the producer waits for the previous item's epilogue: the first
    # overlaid slot's, or the last step of an item that fits in the free slots.
    epi_wait_step = min(free, num_k - 1)
    if free < 1:
        raise ValueError(
            f"config.num_stages={stages} is too few for the persistent dH kernel at "
            f"block_m={bm}, block_n={bn} and {cons} consumers: its epilogue tiles "
            f"({epilogue_bytes} B) overlay {overlaid} W2 slots of {slot_bytes} B, and at least "
            f"one slot must stay free; use num_stages >= {overlaid + 1}."
        )
    smem = stages * (bm * bk * 2 + slot_bytes)
    if smem > _common.SMEM_BUDGET:  # the margin: ids, scores, dS, barriers
        raise ValueError(
            f"the persistent dH kernel needs {smem} B of SMEM for {stages} stages of "
            f"[{bm}, {bk}] gathered dO rows and [{cols}, {bk}] W2, over the "
            f"{_common.SMEM_BUDGET} B available: lower config.num_stages."
        )
    tf = _common.mma_transforms(dtype)
    a_scratch, a_views = _common.row_gather_buffers(stages, bm, bk, dtype, interpret)
    w_type = plgpu.SMEM((stages, cols, bk), dtype, transforms=tf)
    ap_types, h_types = _persistent_epilogue_types(config)
    if interpret:  # interpret mode does not alias RefUnion members: plain buffers, and
        # one ref serves as every view (it allows one-row slices of the wgmma tiling)
        w_scratch = (w_type, ap_types[-1], h_types[-1])

        def w_views(refs):
            w, ap, h = refs
            return w, (ap,) * len(ap_types), (h,) * len(h_types)
    else:  # the epilogue tiles (A' and H) overlay the last W2 slots
        pad = plgpu.SMEM((free * slot_bytes // 2,), dtype)  # the free slots' bytes
        w_scratch = plgpu.RefUnion(w_type, *((pad, a, h) for a, h in zip(ap_types, h_types)))

        def w_views(refs):
            w, *views = refs
            return w, tuple(v[1] for v in views), tuple(v[2] for v in views)

    def tile(views, *idx):  # an epilogue tile: its (copy view, wgmma view) pair
        return tuple(v.at[idx] for v in views)

    def body(expert_ref, start_ref, rows_ref, ids_ref, s_ref, do_ref, w_ref, h_ref, *refs):
        (dh_out, ap_out, ds_out, a_bufs, w_bufs, ids_smem, s_smem, ds_smem,
         full, empty, ids_bar, s_bar, h_bars, epi_bar, epi_done) = refs
        a_copy, a_mma = a_views(a_bufs)
        b_smem, ap_smem, h_smem = w_views(w_bufs)
        wg = jax.lax.axis_index("wg")
        cta = jax.lax.axis_index("cta")
        my_items = (num_items - cta + num_ctas - 1) // num_ctas  # >= 1: num_ctas <= items

        def item(j):  # (row tile, column block) of this CTA's j-th item
            return item_coords(cta + j * num_ctas, grid_n)

        @pl.when(wg == cons)
        def _producer():
            if config.rebalance_registers:
                _common.role_registers("producer", cons)

            def per_item(j, done):  # done: this CTA's non-empty items so far
                mi, ni = item(j)
                num_rows = rows_ref[mi]

                @pl.when(num_rows > 0)
                def _():
                    p = done % 2
                    # Every producer thread is done reading ids[p] (item done - 2) first.
                    plgpu.commit_smem()
                    plgpu.copy_gmem_to_smem(s_ref.at[mi], s_smem.at[p], s_bar.at[p])
                    plgpu.copy_gmem_to_smem(ids_ref.at[mi], ids_smem.at[p],
                                            ids_bar.at[p])
                    plgpu.barrier_wait(ids_bar.at[p])
                    ids = ids_smem.at[p]
                    w_e = w_ref.at[expert_ref[mi]]  # [n, d]

                    def step(ki, carry):
                        slot = ki % stages
                        k0 = ki * bk

                        @pl.when((done > 0) | (ki >= stages))  # the slot's previous use
                        def _():
                            plgpu.barrier_wait(empty.at[slot])

                        # The previous item's epilogue tiles are free again: before the
                        # first overlaid slot, or (an item within the free slots) before
                        # the item's last step. Not after it: the consumers could then
                        # finish this item's epilogue too and complete epi_done's next
                        # phase before this wait observed the previous one (on the GPU the
                        # wait would then block on a phase that never completes).
                        @pl.when((done > 0) & (ki == epi_wait_step))
                        def _():
                            plgpu.barrier_wait(epi_done)

                        _issue_k_step(do_ref, ids, w_e, ni * cols, cols, k0, bk,
                                      a_copy.at[slot], a_mma.at[slot], b_smem.at[slot],
                                      full.at[slot], cp_async)
                        if cp_async:  # step ki - (stages - 2), once its rows landed
                            _common.cp_async_publish_lagged(ki, stages - 2, full, stages)
                        return carry

                    jax.lax.fori_loop(0, num_k, step, None)
                    if cp_async:  # the item's last steps
                        _common.cp_async_publish_tail(num_k, stages - 2, full, stages)

                return done + (num_rows > 0).astype(jnp.int32)

            done = jax.lax.fori_loop(0, my_items, per_item, jnp.int32(0))

            # Observe the last releases and the last epilogue, so no phase is left unconsumed.
            @pl.when(done > 0)
            def _():
                for slot in range(min(stages, num_k)):
                    plgpu.barrier_wait(empty.at[slot])
                plgpu.barrier_wait(epi_done)

        for c in range(cons):
            @pl.when(wg == c)
            def _consumer(c=c):
                if config.rebalance_registers:
                    _common.role_registers("consumer", cons)
                bar0 = c * num_ladder

                def per_item(j, done):
                    mi, ni = item(j)
                    num_rows = rows_ref[mi]

                    @pl.when(num_rows > 0)
                    def _():
                        p = done % 2
                        row0, count = start_ref[mi], num_rows
                        count_ref = rows_ref.at[pl.ds(mi, 1)]  # [1]: the rows H loads
                        c0 = ni * cols + c * bn  # first dA' column of this consumer

                        def mma_scope(acc):
                            def wait(ki, slot):
                                del ki
                                plgpu.barrier_wait(full.at[slot])

                            def mma(slot):  # the whole stage, this consumer's W2 rows
                                w_t = b_smem.at[slot, pl.ds(c * bn, bn)]
                                plgpu.wgmma(acc, a_mma.at[slot], w_t.transpose((1, 0)))

                            _common.consumer_k_loop(num_k, stages, wait, mma, empty,
                                                    mmas_per_step=1)
                            plgpu.barrier_arrive(empty.at[(num_k - 1) % stages])
                            return acc[...]

                        with jax.named_scope("k_loop"):
                            da = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn), jnp.float32))
                        # The epilogue's tiles overlay W2 slots: both consumers are done
                        # with every K step first.
                        with jax.named_scope("epilogue_sync"):
                            plgpu.barrier_arrive(epi_bar)
                            plgpu.barrier_wait(epi_bar)
                        h_gate = h_ref.at[:, pl.ds(c0, bn)]  # [P, bn]
                        h_up = h_ref.at[:, pl.ds(n + c0, bn)]  # [P, bn]
                        with jax.named_scope("h_load"):
                            if h_cp_async:  # this consumer's threads: cp.async, zero-filled
                                for half, col in enumerate((c0, n + c0)):
                                    _common.cp_async_load_rows(
                                        h_ref.at[pl.ds(row0, bm), pl.ds(col, bn)],
                                        [h_smem[1].at[c, half, s] for s in range(bn // 64)],
                                        count_ref,
                                    )
                            else:
                                for half, src in enumerate((h_gate, h_up)):
                                    load_row_tile(src, h_smem[0].at[c, half], row0,
                                                  count, bm, h_bars, True, bar0)
                            plgpu.barrier_wait(s_bar.at[p])
                            if h_cp_async:
                                _common.cp_async_stage_done(0)
                                plgpu.commit_smem()  # every thread's rows, to all of them
                            else:
                                load_row_tile(h_gate, h_smem[0].at[c, 0], row0, count,
                                              bm, h_bars, False, bar0)
                        with jax.named_scope("epilogue"):
                            _dswiglu_and_store(
                                da, s_smem.at[p], tile(h_smem, c, 0), tile(h_smem, c, 1),
                                tile(ap_smem, c), ds_smem.at[c],
                                dh_out, ap_out,
                                ds_out.at[mi, ni * cons + c],
                                c0, n, row0, count, bm, ep_cols, activation,
                            )
                        plgpu.barrier_arrive(epi_done)  # the tiles' bytes are free again

                    return done + (num_rows > 0).astype(jnp.int32)

                jax.lax.fori_loop(0, my_items, per_item, jnp.int32(0))

    scratch = [
        a_scratch,  # gathered dO stages [stages, bm, bk]
        w_scratch,  # W2 stages [stages, C*bn, bk]; the last `overlaid` hold A' and H later
        plgpu.SMEM((2, bm), jnp.int32),  # token ids, double-buffered
        plgpu.SMEM((2, bm), jnp.float32),  # scores, double-buffered
        plgpu.SMEM((cons, bm), jnp.float32),  # per consumer: dS partial
        plgpu.Barrier(  # full: the W2 copy plus what the row loader adds
            num_arrivals=_common.gather_full_arrivals(config, bm, interpret) + 1,
            num_barriers=stages,
        ),
        plgpu.Barrier(num_arrivals=cons, num_barriers=stages),  # empty: the consumers
        plgpu.Barrier(num_barriers=2),  # ids
        plgpu.Barrier(num_barriers=2),  # scores
        # H boxes: per ladder box, the gate and up halves, each in bn / 64 slabs
        plgpu.Barrier(num_arrivals=2 * (bn // 64), num_barriers=cons * num_ladder),
        plgpu.Barrier(num_arrivals=cons),  # consumers done with the item's K loop
        plgpu.Barrier(num_arrivals=cons),  # epi_done: consumers done with the epilogue's tiles
    ]
    return _persistent_call(body, scratch, num_ctas, cons, out_types, config, interpret_mode)


def _persistent_call(body, scratch, num_ctas: int, consumers: int, out_types, config: DHConfig,
                     interpret_mode):
    """`plgpu.kernel` of a persistent dH body: `num_ctas` CTAs of `consumers` consumer
    warpgroups and one producer, Lane semantics."""
    return plgpu.kernel(
        body,
        kernel_name="moe_dh",
        out_type=out_types,
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             approx_math=config.approx_math),
        interpret=interpret_mode,
    )
