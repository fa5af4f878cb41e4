"""dH: the backward's first grouped GEMM, the mirror image of the up-proj.

    dA'[r] = dO[tok[r]] @ W2[e(r)]^T           f32 [bm, bn] per CTA, never written
    A[r]   = act(H_g[r], H_u[r])               recomputed from the saved H (fp32)
    dH[r]  = act'(H_g[r], H_u[r], s[r] * dA'[r])   bf16 [P_pad, 2n]
    A'[r]  = s[r] * A[r]                       bf16 [P_pad, n]   (feeds dW2)
    dS[r]  = <dA'[r], A[r]>                    f32 [P]           (router-score gradient)

`act` is the `SwiGLU` spec (`silu(g) * u`: act' = [D * u * sig * (1 + g * (1 - sig)),
D * g * sig]; or gpt-oss's clamped variant, whose gradient is zero where a clamp is active),
computed by the spec's own `apply` / `grad_halves`, the formula of the `xla` backend. H is
the saved biased pre-activation, so the up-proj bias needs nothing here; the down-proj
bias's term of dS, `<dO[tok[r]], b2[e]>`, is added by `moe_backward` (`bias_grad`).

One CTA computes one (row tile, column block) pair, exactly like the up-proj: a row tile
holds at most `block_m` rows of one expert (`tile_meta`), a column block `j` holds columns
`[j*bn, (j+1)*bn)` of dA' and therefore gate columns `j*bn + [0, bn)` and up columns
`n + j*bn + [0, bn)` of H and dH.

The gather: each of the `block_m` rows of an A stage is its own `[1, block_k]` TMA copy
`dO[tok, k:k+bk] -> a_smem[slot, r]` (`row_gather_buffers`); no gathered `[P, d]` copy of dO
is ever written. B is `W2[e][j*bn:(j+1)*bn, k:k+bk]` (`[bn, bk]`, K-minor), fed to wgmma
transposed, so the public `[E, n, d]` layout is read as is.

The epilogue's H rows (gate and up blocks) and the tile's scores are TMA-loaded at the start
of the CTA, so they arrive while the K loop runs. H is loaded row-exactly (a power-of-two
ladder of boxes, like `store_rows`), so nothing past the tile's rows, and nothing past `P`, is
read. dH and A' rows are TMA-stored row-exactly. dS is reduced over the CTA's `bn` columns in
registers and written as a per-(tile, column block) partial `[num_tiles, grid_n, bm]` (each
CTA owns its slot: no atomics); `reduce_row_partials` sums the partials in a fixed order.

The kernel is warp-specialized (`_dh_warp_specialized`): a producer warpgroup issues the
row copies from its 4 warps and C consumer warpgroups (`DHConfig.num_consumers`) share each
gathered stage. (Session 22 removed the one-warpgroup kernel that issued every copy and
every wgmma itself: 52 TF/s against 156 with 2 consumers at 7B on the H100, and no default
used it.)

The default of `BackwardConfig.for_shape` is the warp-specialized kernel as persistent CTAs
(`DHConfig.persistent_ctas`, `_dh_persistent`) whose epilogue tiles are 128-byte-swizzled
64-column slabs (`epilogue_layout="swizzled"`): the accumulator layout's SMEM reads and
writes hit every bank once, where untiled rows of 256 bytes put the 8 rows a warp touches in
one bank. Each consumer fills its slabs with H by its own 16-byte cp.async loads
(`h_loader="cp_async"`, `_common.cp_async_load_rows`: rows past the tile zero-filled, none
read past the array); TMA boxes into the slabs measured slower than the conflicts they
remove (benchmarks/RESULTS.md, sessions 19 and 21). Interpret mode runs the TMA ladder in
their place (it cannot run cp.async).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels._common import TileMeta
from pallas_moe.ops.activation import SwiGLU


EPILOGUE_LAYOUTS = ("untiled", "swizzled")
H_LOADERS = ("tma", "cp_async")


@dataclasses.dataclass(frozen=True)
class DHConfig:
    """Block sizes of the dH kernel.

    Attributes:
      block_m: rows per tile (a multiple of 64: one wgmma M=64 per 64 rows).
      block_n: columns of dA' per CTA (multiple of 64, divides n, at most 256); the CTA
        writes 2*block_n columns of dH and block_n of A'.
      block_k: contraction step over d; must be 64 (one 128-byte swizzle row of bf16).
      num_stages: SMEM pipeline depth.
      pad_rows_to: dH and A' get `P` rounded up to a multiple of this (the dX and weight-
        gradient kernels load whole aligned row blocks); padding rows are not written.
      num_consumers: C >= 1 consumer warpgroups beside the producer warpgroup (which issues
        the gathered row copies from its 4 warps); they share each gathered stage, each
        computing its own `block_n` columns (a CTA covers C * block_n columns, which must
        divide n).
      gather: how the producer gathers rows: "tma" (one `[1, 64]` TMA copy per row chunk;
        the loader interpret mode runs) or "cp_async" (16-byte cp.async loads from all 128
        producer threads, `_common.cp_async_gather_rows`; compiled kernels only, needs
        `num_stages >= 3`; interpret mode falls back to "tma").
      gather_completion: with gather="cp_async", "mbarrier" (hardware-tracked stages, all in
        flight) or "wait_group" (lagged publish); see `_common.GATHER_COMPLETIONS`.
      rebalance_registers: the producer drops to 40 registers per thread and the consumers
        take the rest (`_common.role_registers`); False keeps the even split, where the
        dSwiGLU epilogue spills.
      prefetch_h: True = the tile's H rows get their own SMEM and are loaded while the K
        loop runs; False = they are loaded after the K loop into the pipeline's SMEM, which
        leaves room for more stages (5 at block_n=128, where prefetching allows only 3).
      epilogue_cols: the dSwiGLU epilogue runs in chunks of this many columns (a multiple of
        8 dividing block_n; 0 = the whole block at once), so only a chunk's temporaries are
        live next to the accumulator. With `persistent_ctas` and
        `epilogue_layout="swizzled"`, a multiple of 64 (whole slabs).
      early_h: with `prefetch_h=False` only: the consumers start loading the tile's H into
        the pipeline's bytes as soon as both are done with every K step whose slot those
        bytes overlay (`_h_load_step`), so the load overlaps the last K steps instead of
        following them. False = after the K loop.
      approx_math: compiled kernels only: True (default) = the dSwiGLU's sigmoid takes
        its exp from the hardware's `ex2.approx` (`plgpu.CompilerParams.approx_math`);
        False = the full-precision libdevice `exp`. Measured on the H100 (session 8): 623.6
        -> 581.0 us at 7B, 2927.6 -> 2888.6 us at 30B, same error against the reference.
        It must equal the forward's `UpProjConfig.approx_math` (or
        `DecodeConfig.approx_math`), so A' is recomputed from H as the forward computed A.
        Interpret mode computes the exact exp either way.
      persistent_ctas: 0 = one CTA per (row tile, column block); C > 0 = C persistent CTAs (`_dh_persistent`, e.g. the SM count) walk the
        tiles, the producer loading the next tile's ids, scores and first K steps while the
        consumers run the epilogue. Same bits either way. The persistent kernel loads H
        after the K loop into the bytes of its last W2 slots, so it needs
        `early_h = prefetch_h = False`. Its fastest form, what `BackwardConfig.for_shape`
        sets: `epilogue_layout="swizzled", h_loader="cp_async"` (session 21: 1.16x at 7B on
        the H100); a hand-built config keeps the untiled tiles unless it asks for them.
      epilogue_layout: persistent kernel only: how its epilogue tiles (H gate and up, which
        become dH, and A') sit in SMEM. "untiled": [bm, bn] row-major, TMA-loaded and
        -stored in whole boxes; the accumulator layout's reads and writes hit one bank 8 times
        (a warp touches 8 rows of 256 bytes). "swizzled": 128-byte-swizzled 64-column slabs
        (`_common.row_tile_types`), free of bank conflicts, stored per slab.
      h_loader: persistent kernel with `epilogue_layout="swizzled"` only: how H reaches its
        slabs. "tma": a row-exact ladder of TMA boxes per slab (`load_row_tile`); "cp_async":
        the consumer's own 128 threads issue 16-byte cp.async loads straight into the
        swizzled layout, rows past the tile's zero-filled (`_common.cp_async_load_rows`;
        compiled kernels only, interpret mode runs "tma").
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    pad_rows_to: int = 64
    num_consumers: int = 1
    gather: str = "tma"
    rebalance_registers: bool = True
    # BackwardConfig.for_shape picks per width (measured: see there).
    gather_completion: str = "wait_group"
    prefetch_h: bool = False
    epilogue_cols: int = 64
    early_h: bool = False
    approx_math: bool = True
    persistent_ctas: int = 0
    epilogue_layout: str = "untiled"
    h_loader: str = "tma"


def _check(grad_out, h, w_down, token_ids, scores, config: DHConfig):
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
    bn, bk = config.block_n, config.block_k
    _common.require_wgmma_blocks(config, "B tiles are 128-byte swizzled")
    if config.pad_rows_to < 1:
        raise ValueError(f"config.pad_rows_to={config.pad_rows_to} must be >= 1.")
    if config.num_consumers < 1:
        raise ValueError(
            f"config.num_consumers={config.num_consumers} must be >= 1 (consumer warpgroups "
            "beside the producer)."
        )
    if config.epilogue_cols and (config.epilogue_cols % 8 or bn % config.epilogue_cols):
        raise ValueError(
            f"config.epilogue_cols={config.epilogue_cols} must be 0 or a multiple of 8 dividing "
            f"block_n={bn}."
        )
    _common.require_gather_mode(config)
    if config.persistent_ctas < 0:
        raise ValueError(f"config.persistent_ctas={config.persistent_ctas} must be >= 0.")
    if config.persistent_ctas and (config.early_h or config.prefetch_h):
        raise ValueError(
            f"config.persistent_ctas={config.persistent_ctas} needs H loaded after the K loop: "
            f"early_h=False (got {config.early_h}) and prefetch_h=False (got "
            f"{config.prefetch_h})."
        )
    if config.epilogue_layout not in EPILOGUE_LAYOUTS:
        raise ValueError(
            f"config.epilogue_layout={config.epilogue_layout!r} must be one of {EPILOGUE_LAYOUTS}."
        )
    if config.h_loader not in H_LOADERS:
        raise ValueError(f"config.h_loader={config.h_loader!r} must be one of {H_LOADERS}.")
    swizzled = config.epilogue_layout == "swizzled"
    if swizzled and not config.persistent_ctas:
        raise ValueError(
            "config.epilogue_layout='swizzled' belongs to the persistent kernel: set "
            "persistent_ctas > 0, or leave it 'untiled'."
        )
    if config.h_loader != "tma" and not swizzled:
        raise ValueError(
            f"config.h_loader={config.h_loader!r} loads H into swizzled slabs: set "
            "epilogue_layout='swizzled' (and persistent_ctas > 0), or leave it 'tma'."
        )
    if swizzled and config.epilogue_cols % 64:
        raise ValueError(
            f"config.epilogue_cols={config.epilogue_cols} must be 0 or a multiple of 64 with "
            "epilogue_layout='swizzled': the epilogue tiles are 64-column slabs."
        )
    _common.require_multiple("d (grad_out.shape[1])", d, bk, f"the K loop steps by block_k={bk}")
    cols = bn * config.num_consumers
    _common.require_multiple(
        "n (w_down.shape[1])", n, cols,
        f"a CTA computes block_n * num_consumers = {cols} columns of dA'",
    )
    return d, n, num_experts


def load_rows(src_gmem, dst_smem, row0, num_rows, max_rows: int, bars, issue: bool, bar0=0):
    """TMA-loads rows `[row0, row0 + num_rows)` of `src_gmem` into rows `[0, num_rows)` of an
    untiled SMEM block, as a power-of-two ladder of boxes (the mirror of `store_rows`).

    Box `i` (height `2**i`) arrives on `bars.at[i]`, so the number of arrivals per barrier is
    static. With `issue=True` this starts the copies; with `issue=False` it waits on the
    barriers of the boxes once (one wait covers every block issued with the same `bars`, row0
    and num_rows, if the barriers count that many arrivals). Box `i` uses `bars.at[bar0 + i]`.
    Rows past `num_rows` are not touched.
    """
    start = 0  # a Python int until the first dynamic step (Mosaic wants Values or ints)
    size = 1 << (max_rows.bit_length() - 1)
    i = 0
    while size >= 1:
        this, bar = size, bars.at[bar0 + i]

        @pl.when((num_rows & this) != 0)
        def _():
            if issue:
                plgpu.copy_gmem_to_smem(
                    src_gmem.at[pl.ds(row0 + start, this)], dst_smem.at[pl.ds(start, this)], bar
                )
            else:
                plgpu.barrier_wait(bar)

        start = start + (num_rows & this)
        size //= 2
        i += 1


def _smem_layout(bm: int, bn: int, bk: int, stages: int, cons: int):
    """SMEM of the warp-specialized kernel (`gathered_pipeline_smem`'s arguments): the dO
    stages' shape, the pipeline's other arrays (W2 stages, then the tile's token ids and
    scores), the epilogue's arrays before H (A', dS partials) and H's type."""
    dtype = jnp.bfloat16
    others = [
        plgpu.SMEM((stages, cons * bn, bk), dtype, transforms=_common.mma_transforms(dtype)),
        # Token ids and scores of the tile, past the bytes the epilogue reuses (packed here
        # rather than as separate buffers, which are each padded to 1 KB).
        plgpu.SMEM((bm,), jnp.int32),
        plgpu.SMEM((bm,), jnp.float32),
    ]
    epilogue = [
        plgpu.SMEM((cons, bm, bn), dtype),  # per consumer: A'
        plgpu.SMEM((cons, bm), jnp.float32),  # per consumer: dS partial
    ]
    h_type = plgpu.SMEM((cons, 2, bm, bn), dtype)  # per consumer: H gate, H up -> dH
    return (stages, bm, bk), others, epilogue, h_type


def _h_load_step(bm: int, bn: int, bk: int, stages: int, cons: int, num_k: int) -> int:
    """The first K step at which the warp-specialized kernel's consumers may start loading
    H (`early_h`): one past the last step whose pipeline slot shares bytes with the H tiles
    the epilogue overlays (`num_k`: only after the K loop). The bytes come from the kernel's
    own `_smem_layout`, placed as Pallas places a `RefUnion` group (`_common.group_spans`).
    """
    a_shape, others, epilogue, h_type = _smem_layout(bm, bn, bk, stages, cons)
    stage_arrays = _common.group_spans([plgpu.SMEM(a_shape, jnp.bfloat16), others[0]])
    h_lo, h_hi = _common.group_spans([*epilogue, h_type])[-1]

    def overlays_h(slot):
        for lo, hi in stage_arrays:
            step = (hi - lo) // stages
            if lo + slot * step < h_hi and h_lo < lo + (slot + 1) * step:
                return True
        return False

    used = [ki for ki in range(num_k) if overlays_h(ki % stages)]
    return (max(used) + 1) if used else 0


def ladder_len(max_rows: int) -> int:
    """Number of boxes (and barriers) `load_rows` uses for blocks of `max_rows` rows."""
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
    """
    act = activation.apply(g, u)
    d_gate, d_up = activation.grad_halves(g, u, s * da)
    return d_gate, d_up, s * act, jnp.sum(da * act, axis=1)


def _dswiglu_and_store(da, s_smem, hg_ref, hu_ref, ap_ref, ds_ref, dh_out, ap_out, ds_dst, c0,
                       n: int, row0, num_rows, bm: int, ep_cols: int, activation: SwiGLU):
    """A warp-specialized consumer's epilogue, once its H tile is in SMEM: dSwiGLU in column
    chunks, then the row-exact TMA stores of dH and A' and the copy of its dS partial.

    Args:
      da: f32 [bm, bn] accumulator (dA' of the consumer's `bn` columns, from column c0).
      s_smem: f32 [bm] scores of the tile's rows; ds_ref: f32 [bm].
      hg_ref, hu_ref: the H gate and up columns, overwritten with dH; ap_ref: the A' tile.
        Each is either an untiled bf16 [bm, bn] SMEM ref, or a `_common.row_tile_types`
        pair (copy view, wgmma view) of [bn / 64, bm, 64] 128-byte-swizzled slabs, whose
        register reads and writes are free of bank conflicts (an untiled row of 256 bytes
        puts the 8 rows a warp touches in the same banks: 8-way conflicts). Tiled, `ep_cols`
        must be a multiple of 64 (whole slabs).
      dh_out, ap_out: the GMEM outputs [P_pad, 2n] and [P_pad, n]; ds_dst: f32 [bm] slot of
        the dS partials.

    Returns once the stores have read the SMEM tiles (the caller may reuse them).
    """
    tiled = isinstance(hg_ref, tuple)
    layout = plgpu.Layout.WGMMA
    if tiled:
        slab = hg_ref[1].shape[-1]
        bn = hg_ref[1].shape[-3] * slab
        dtype = hg_ref[1].dtype
        assert ep_cols % slab == 0, (ep_cols, slab)

        def read(tile, q):  # [bm, ep_cols] of chunk q, wgmma layout
            first = q * ep_cols // slab
            return jnp.concatenate(
                [tile[1][h] for h in range(first, first + ep_cols // slab)], axis=1)

        def write(tile, q, value):
            _common.write_row_tile(tile[1], value, first_slab=q * ep_cols // slab)

        def store(tile, dst):
            _common.store_row_tile(tile[0], dst, row0, num_rows, bm)
    else:
        bn = hg_ref.shape[1]
        dtype = hg_ref.dtype

        def read(ref, q):
            return plgpu.load(ref.at[:, pl.ds(q * ep_cols, ep_cols)], layout=layout,
                              optimized=False)

        def write(ref, q, value):
            # Same layout as the loads: each thread overwrites only what it read.
            ref[:, pl.ds(q * ep_cols, ep_cols)] = value

        def store(ref, dst):
            _common.store_rows(ref, dst, row0, num_rows, bm)

    s = plgpu.load(s_smem, layout=layout.reduce(1))  # [bm] f32
    s = jax.lax.broadcast_in_dim(s, (bm, ep_cols), [0])
    ds = None
    # In column chunks: only a chunk's H, temporaries and results are live next to the
    # accumulator (the whole tile at once spills).
    with jax.named_scope("dswiglu"):
        for q in range(bn // ep_cols):
            g, u = read(hg_ref, q), read(hu_ref, q)
            d_gate, d_up, a_scaled, ds_q = dswiglu_epilogue(
                da[:, q * ep_cols:(q + 1) * ep_cols], g.astype(jnp.float32),
                u.astype(jnp.float32), s, activation,
            )
            ds = ds_q if ds is None else ds + ds_q
            write(hg_ref, q, d_gate.astype(dtype))
            write(hu_ref, q, d_up.astype(dtype))
            write(ap_ref, q, a_scaled.astype(dtype))
        ds_ref[...] = ds
        plgpu.commit_smem()
    with jax.named_scope("store"):
        store(hg_ref, dh_out.at[:, pl.ds(c0, bn)])
        store(hu_ref, dh_out.at[:, pl.ds(n + c0, bn)])
        store(ap_ref, ap_out.at[:, pl.ds(c0, bn)])
        plgpu.copy_smem_to_gmem(ds_ref, ds_dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def load_row_tile(src_gmem, copy_view, row0, num_rows, max_rows: int, bars, issue: bool,
                  bar0=0):
    """`load_rows` into a `_common.row_tile_types` tile (copy view [slabs, max_rows, w]):
    slab h gets `src_gmem[row0 + i, w h : w (h + 1)]`. Issuing, every slab's boxes arrive on
    the same ladder barriers (count `slabs` arrivals per tile); waiting, each barrier is
    waited on once (`load_rows`' rule)."""
    slabs, w = copy_view.shape[-3], copy_view.shape[-1]
    for h in range(slabs if issue else 1):
        load_rows(src_gmem.at[:, pl.ds(h * w, w)], copy_view.at[h], row0, num_rows, max_rows,
                  bars, issue, bar0)


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
      meta: precomputed `tile_meta(group_sizes, token_ids, config.block_m)`.
      activation: the forward's `SwiGLU` spec.

    Returns:
      (dh bf16 [P_pad, 2n], a_scaled bf16 [P_pad, n], d_scores f32 [P]) with P_pad = P
      rounded up to `config.pad_rows_to`. Rows of dh and a_scaled past `sum(group_sizes)`
      are not written (unspecified); d_scores is 0 there.
    """
    d, n, num_experts = _check(grad_out, h, w_down, token_ids, scores, config)
    _common.require_shape("group_sizes", group_sizes, (num_experts,))
    capacity = token_ids.shape[0]
    bm, bn = config.block_m, config.block_n
    if meta is None:
        meta = _common.tile_meta(group_sizes, token_ids, bm)
    if meta.block_m != bm:
        raise ValueError(f"meta.block_m={meta.block_m} must equal config.block_m={bm}.")
    num_tiles = meta.num_tiles
    grid_n = n // bn
    dtype = grad_out.dtype
    s_tiles = tile_scores(scores, meta)  # [nt, bm]
    rows_pad = -(-capacity // config.pad_rows_to) * config.pad_rows_to
    out_types = (
        jax.ShapeDtypeStruct((rows_pad, 2 * n), dtype),  # dH
        jax.ShapeDtypeStruct((rows_pad, n), dtype),  # A'
        jax.ShapeDtypeStruct((num_tiles, grid_n, bm), jnp.float32),  # dS partials
    )
    interpret_mode = _common.interpret_params(interpret)
    args = (meta.expert, meta.row_start, meta.num_rows, meta.row_ids, s_tiles, grad_out, w_down, h)
    build = _dh_persistent if config.persistent_ctas else _dh_warp_specialized
    kernel = build(config, d, n, num_tiles, out_types, interpret_mode, activation)
    dh, a_scaled, ds_part = kernel(*args)
    return dh, a_scaled, reduce_row_partials(ds_part, meta, capacity)


def _issue_k_step(do_ref, ids, w_e, col0, cols: int, k0, bk: int, a_copy, a_mma, b_slot,
                  full_bar, cp_async: bool) -> None:
    """Producer warpgroup, one K step of a warp-specialized dH kernel: the `[cols, bk]` W2
    tile `w_e[col0:col0+cols, k0:k0+bk]` (K-minor) and the gathered dO rows
    `dO[ids[r], k0:k0+bk]` of the slot, arriving on `full_bar`. With cp.async the rows are
    one cp.async group the caller publishes (`_common.cp_async_publish`); otherwise each of
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


def _dh_warp_specialized(config: DHConfig, d: int, n: int, num_tiles: int, out_types,
                         interpret_mode, activation: SwiGLU = SwiGLU()):
    """The dH kernel as one producer warpgroup + `config.num_consumers` consumer warpgroups.

    Producer (warpgroup C): stages the tile's token ids and scores in SMEM, then for every K
    step waits until the consumers released the slot (`empty`), issues the `block_m` one-row
    copies of the gathered dO stage from its 4 warps in parallel (`plgpu.warp_map`), and the
    `[C * block_n, block_k]` W2 tile, all arriving on `full[slot]`.
    Consumer c < C: first starts the TMA loads of its own H gate/up columns (they land while
    the K loop runs), then waits `full[slot]`, issues wgmma on the shared dO stage and its own
    `block_n` rows of the W2 tile, and releases the slot once the next step's wgmma is issued.
    Its epilogue overwrites its H tile in SMEM with dH (each thread rewrites exactly the
    elements it read), writes A' and its dS partial, and stores them row-exactly. It runs in
    chunks of `config.epilogue_cols` columns, so only one chunk's H and temporaries are live
    next to the accumulator (the whole block at once spilled: 908 vs 604 us at 7B, session 6).
    """
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    cons = config.num_consumers
    cols = cons * bn
    ep_cols = config.epilogue_cols or bn
    if not config.prefetch_h:
        # The epilogue's A', dS and H tiles overlay the pipeline's stages; past them lie the
        # tile's token ids and scores, which the epilogue still reads.
        stage_bytes = (bm + cols) * bk * 2
        epilogue_bytes = cons * bm * (3 * bn * 2 + 4)
        if epilogue_bytes > stages * stage_bytes:
            raise ValueError(
                f"config.num_stages={stages} is too few for block_m={bm}, block_n={bn} and "
                f"{cons} consumers: the epilogue's tiles ({epilogue_bytes} B) must fit in the "
                f"pipeline's stages ({stage_bytes} B each) they overlay; use num_stages >= "
                f"{-(-epilogue_bytes // stage_bytes)} or prefetch_h=True."
            )
    num_k = d // bk
    grid_n = n // cols
    dtype = jnp.bfloat16
    num_ladder = ladder_len(bm)
    h_step = _h_load_step(bm, bn, bk, stages, cons, num_k)
    # Interpret mode keeps the epilogue's buffers apart from the pipeline's: any step works.
    early = config.early_h and not config.prefetch_h and 1 <= h_step < num_k
    # Interpret mode cannot run cp.async: it runs the same kernel with the TMA row loader.
    cp_async = config.gather == "cp_async" and interpret_mode is None
    stage_bars = _common.uses_stage_mbarriers(config, interpret_mode is not None)

    def body(expert_ref, start_ref, rows_ref, ids_ref, s_ref, do_ref, w_ref, h_ref,
             dh_out, ap_out, ds_out, *scratch):
        if prefetch_h:
            bufs, h_smem, full, empty, ids_bar, h_bars, s_bar, epi_bar, h_ready, *a_landed = scratch
            a_copy, a_mma, (b_smem, ids_smem, s_smem), (ap_smem, ds_smem) = views(bufs)
        else:
            bufs, full, empty, ids_bar, h_bars, s_bar, epi_bar, h_ready, *a_landed = scratch
            a_copy, a_mma, (b_smem, ids_smem, s_smem), (ap_smem, ds_smem, h_smem) = views(bufs)
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
            plgpu.copy_gmem_to_smem(s_ref.at[mi], s_smem, s_bar)  # [bm] f32
            plgpu.copy_gmem_to_smem(ids_ref.at[mi], ids_smem, ids_bar)
            plgpu.barrier_wait(ids_bar)
            w_e = w_ref.at[expert]  # [n, d]

            def step(ki, carry):
                slot = ki % stages
                k0 = ki * bk

                @pl.when(ki >= stages)
                def _():
                    plgpu.barrier_wait(empty.at[slot])

                _issue_k_step(do_ref, ids_smem, w_e, ni * cols, cols, k0, bk, a_copy.at[slot],
                              a_mma.at[slot], b_smem.at[slot], full.at[slot], cp_async)
                if cp_async:
                    _common.cp_async_publish(ki, full, a_landed, stages)
                return carry

            jax.lax.fori_loop(0, num_k, step, None)
            if cp_async:
                _common.cp_async_publish_rest(num_k, full, a_landed, stages)

        for c in range(cons):
            @pl.when((num_rows > 0) & (wg == c))
            def _consumer(c=c):
                if config.rebalance_registers:
                    _common.role_registers("consumer", cons)
                row0 = start_ref[mi]
                c0 = ni * cols + c * bn  # first dA' column of this consumer
                h_gate = h_ref.at[:, pl.ds(c0, bn)]  # [P, bn]
                h_up = h_ref.at[:, pl.ds(n + c0, bn)]  # [P, bn]
                bar0 = c * num_ladder

                def start_h_loads():  # this consumer's H gate and up rows -> h_smem[c]
                    load_rows(h_gate, h_smem.at[c, 0], row0, num_rows, bm, h_bars, True, bar0)
                    load_rows(h_up, h_smem.at[c, 1], row0, num_rows, bm, h_bars, True, bar0)

                if prefetch_h:  # H lands while the K loop runs
                    start_h_loads()

                def mma_scope(acc):
                    def wait(ki, slot):
                        plgpu.barrier_wait(full.at[slot])
                        _common.cp_async_consumer_wait(ki, a_landed, stages)

                    def mma(slot):
                        w_t = b_smem.at[slot, pl.ds(c * bn, bn)]  # [bn, bk]
                        plgpu.wgmma(acc, a_mma.at[slot], w_t.transpose((1, 0)))

                    def after_mma(ki):
                        if early:  # every step before ki is done: H's bytes are free
                            @pl.when(ki == h_step)
                            def _():
                                plgpu.barrier_arrive(h_ready)
                                plgpu.barrier_wait(h_ready)
                                start_h_loads()

                    # Only the releases the producer waits for (step ki-1 + stages exists),
                    # so every completed phase of `empty` is observed.
                    _common.consumer_k_loop(
                        num_k, stages, wait, mma, empty, mmas_per_step=1, after_mma=after_mma,
                        release_if=lambda ki: (ki >= 1) & (ki - 1 + stages < num_k))
                    return acc[...]

                da = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn), jnp.float32))  # [bm, bn]
                # A' and dS reuse the pipeline's SMEM: every consumer is done reading it first.
                plgpu.barrier_arrive(epi_bar)
                plgpu.barrier_wait(epi_bar)
                if not prefetch_h and not early:  # H goes into the pipeline's SMEM, now free
                    start_h_loads()
                plgpu.barrier_wait(s_bar)
                load_rows(h_gate, h_smem.at[c, 0], row0, num_rows, bm, h_bars, False, bar0)
                _dswiglu_and_store(
                    da, s_smem, h_smem.at[c, 0], h_smem.at[c, 1], ap_smem.at[c], ds_smem.at[c],
                    dh_out, ap_out, ds_out.at[mi, ni * cons + c], c0, n, row0, num_rows, bm,
                    ep_cols, activation,
                )

    # Per consumer: H gate, H up -> dH gate, dH up.
    a_shape, others, epilogue, h_type = _smem_layout(bm, bn, bk, stages, cons)
    h_types = [h_type]
    prefetch_h = config.prefetch_h
    bufs, views = _common.gathered_pipeline_smem(
        a_shape, dtype, others=others,
        epilogue=[*epilogue, *([] if prefetch_h else h_types)],
        interpret=interpret_mode is not None,
    )
    scratch = [
        bufs,  # gathered dO stages [stages, bm, bk] + W2 stages + ids + scores; then A', dS
        *(h_types if prefetch_h else []),
        # full: the W2 copy plus what the row loader adds
        plgpu.Barrier(
            num_arrivals=_common.gather_full_arrivals(config, bm, interpret_mode is not None) + 1,
            num_barriers=stages,
        ),
        plgpu.Barrier(num_arrivals=cons, num_barriers=stages),  # empty
        plgpu.Barrier(),  # ids
        plgpu.Barrier(num_arrivals=2, num_barriers=cons * num_ladder),  # H boxes
        plgpu.Barrier(),  # scores
        plgpu.Barrier(num_arrivals=cons),  # consumers done with the pipeline
        plgpu.Barrier(num_arrivals=cons),  # consumers done with the steps H overlays
        *([_common.cp_async_stage_barriers(stages)] if stage_bars else []),
    ]
    return plgpu.kernel(
        body,
        kernel_name="moe_dh",
        out_type=out_types,
        scratch_types=scratch,
        grid=(grid_n, num_tiles),
        grid_names=("n", "m"),
        num_threads=cons + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             approx_math=config.approx_math),
        interpret=interpret_mode,
    )


def _persistent_epilogue_types(bm: int, bn: int, cons: int, swizzled: bool):
    """The persistent kernel's epilogue tiles, per consumer: A' [bm, bn] and H gate / up
    [2, bm, bn] (overwritten with dH), as ((A' views), (H views)). Untiled: one view each
    (`(ref_type,)`). Swizzled (`DHConfig.epilogue_layout`): `_common.row_tile_types` (copy
    view, wgmma view) pairs of 128-byte-swizzled 64-column slabs. Measured on the H100
    (session 19, `benchmarks/timeline.py`): with untiled [bm, bn] tiles the epilogue's SMEM
    reads and writes (8-way bank conflicts) took ~4.7 of its ~7.5 us per 7B item."""
    if swizzled:
        return (_common.row_tile_types((cons, bm, bn), jnp.bfloat16),
                _common.row_tile_types((cons, 2, bm, bn), jnp.bfloat16))
    return ((plgpu.SMEM((cons, bm, bn), jnp.bfloat16),),
            (plgpu.SMEM((cons, 2, bm, bn), jnp.bfloat16),))


def _persistent_layout(bm: int, bn: int, bk: int, cons: int, swizzled: bool):
    """(overlaid, W2 slot bytes, epilogue bytes) of the persistent kernel's SMEM: the
    epilogue's A' and H tiles overlay the last `overlaid` W2 slots, so the next item's first
    `stages - overlaid` steps can load while the consumers run the epilogue."""
    slot_bytes = cons * bn * bk * 2
    ap_views, h_views = _persistent_epilogue_types(bm, bn, cons, swizzled)
    epilogue_bytes = _common.group_spans([ap_views[-1], h_views[-1]])[-1][1]
    return -(-epilogue_bytes // slot_bytes), slot_bytes, epilogue_bytes


def _dh_persistent(config: DHConfig, d: int, n: int, num_tiles: int, out_types,
                   interpret_mode, activation: SwiGLU = SwiGLU()):
    """The warp-specialized dH kernel as `config.persistent_ctas` persistent CTAs.

    CTA `i` walks the work items `i, i + num_ctas, ...` (item = (row tile, column block),
    row tiles fastest, the order of the one-CTA-per-item grid), each item computed exactly as
    `_dh_warp_specialized` computes its CTA's tile (same wgmmas in the same order, same
    epilogue), so the outputs are bitwise those of that kernel. What persistence buys: the
    producer runs ahead into the next item (its token ids, scores and first K steps) while
    the consumers run the epilogue, and no CTA is relaunched per tile.

    Pipeline: every item's K loop starts at slot 0 (`slot = ki % stages`). The epilogue's A'
    and H tiles overlay the last `overlaid` W2 slots (`_persistent_layout`); the gathered dO
    slots and the first W2 slots stay free, so the producer may fill the next item's steps
    `[0, stages - overlaid)` at once, and waits for the consumers' `epi_done` (their stores
    have read the tiles) before its first overlaid slot, or before the last step of an item
    with no more steps than free slots (so the consumers never complete `epi_done`'s next
    phase before the producer observed the previous one). Every slot use is released by the
    consumers, and the producer waits for the release of a slot's previous use (across
    items), then observes the last ones before exit. Token ids and scores are
    double-buffered by the parity of the CTA's count of non-empty items. With the lagged
    cp.async publish the producer publishes an item's last steps at its end (a short stall
    while the consumers still have the item's last steps to compute); with per-slot
    mbarriers the consumers wait on each slot's phase parity counted across items.
    """
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.num_stages
    cons = config.num_consumers
    cols = cons * bn
    ep_cols = config.epilogue_cols or bn
    num_k = d // bk
    grid_n = n // cols
    num_items = num_tiles * grid_n
    num_ctas = min(config.persistent_ctas, num_items)
    dtype = jnp.bfloat16
    num_ladder = ladder_len(bm)
    interpret = interpret_mode is not None
    cp_async = config.gather == "cp_async" and not interpret
    stage_bars = _common.uses_stage_mbarriers(config, interpret)
    swizzled = config.epilogue_layout == "swizzled"
    h_cp_async = config.h_loader == "cp_async" and not interpret
    overlaid, slot_bytes, epilogue_bytes = _persistent_layout(bm, bn, bk, cons, swizzled)
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
    # Uses of slot s per item (the K loop restarts at slot 0): the mbarrier phase parity.
    uses_per_item = lambda slot: (num_k - slot + stages - 1) // stages  # noqa: E731
    tf = _common.mma_transforms(dtype)
    a_scratch, a_views = _common.row_gather_buffers(stages, bm, bk, dtype, interpret)
    w_type = plgpu.SMEM((stages, cols, bk), dtype, transforms=tf)
    ap_types, h_types = _persistent_epilogue_types(bm, bn, cons, swizzled)
    if interpret:  # interpret mode does not alias RefUnion members: plain buffers, and
        # one ref serves as every view (it allows one-row slices of the wgmma tiling)
        w_scratch = (w_type, ap_types[-1], h_types[-1])

        def w_views(refs):
            w, ap, h = refs
            return w, (ap,) * len(ap_types), (h,) * len(h_types)
    else:
        pad = plgpu.SMEM((free * slot_bytes // 2,), dtype)  # the free slots' bytes
        w_scratch = plgpu.RefUnion(w_type, *((pad, a, h) for a, h in zip(ap_types, h_types)))

        def w_views(refs):
            w, *views = refs
            return w, tuple(v[1] for v in views), tuple(v[2] for v in views)

    def tile(views, *idx):  # an epilogue tile: an untiled ref, or a (copy, wgmma) view pair
        tiles = tuple(v.at[idx] for v in views)
        return tiles if swizzled else tiles[0]

    def body(expert_ref, start_ref, rows_ref, ids_ref, s_ref, do_ref, w_ref, h_ref,
             dh_out, ap_out, ds_out, a_bufs, w_bufs, ids_smem, s_smem, ds_smem,
             full, empty, ids_bar, s_bar, h_bars, epi_bar, epi_done, *a_landed):
        a_copy, a_mma = a_views(a_bufs)
        b_smem, ap_smem, h_smem = w_views(w_bufs)
        if stage_bars:
            _common.cp_async_stage_barriers_init(a_landed[0])
        wg = jax.lax.axis_index("wg")
        cta = jax.lax.axis_index("cta")
        my_items = (num_items - cta + num_ctas - 1) // num_ctas  # >= 1: num_ctas <= items

        def item(j):  # (row tile, column block) of this CTA's j-th item
            w = cta + j * num_ctas
            return w % num_tiles, w // num_tiles

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
                    plgpu.copy_gmem_to_smem(ids_ref.at[mi], ids_smem.at[p], ids_bar.at[p])
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
                        if cp_async:
                            _common.cp_async_publish(ki, full, a_landed, stages)
                        return carry

                    jax.lax.fori_loop(0, num_k, step, None)
                    if cp_async:
                        _common.cp_async_publish_rest(num_k, full, a_landed, stages)

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
                        row0 = start_ref[mi]
                        c0 = ni * cols + c * bn  # first dA' column of this consumer

                        def mma_scope(acc):
                            def wait(ki, slot):
                                plgpu.barrier_wait(full.at[slot])
                                if stage_bars:
                                    uses = done * uses_per_item(slot) + ki // stages
                                    _common.cp_async_stage_wait_parity(
                                        a_landed[0].at[slot], uses % 2
                                    )

                            def mma(slot):
                                w_t = b_smem.at[slot, pl.ds(c * bn, bn)]  # [bn, bk]
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
                            load = load_row_tile if swizzled else load_rows
                            if h_cp_async:  # this consumer's threads: cp.async, zero-filled
                                for half, col in enumerate((c0, n + c0)):
                                    _common.cp_async_load_rows(
                                        h_ref.at[pl.ds(row0, bm), pl.ds(col, bn)],
                                        [h_smem[1].at[c, half, s] for s in range(bn // 64)],
                                        rows_ref.at[pl.ds(mi, 1)],
                                    )
                            else:
                                for half, src in enumerate((h_gate, h_up)):
                                    load(src, h_smem[0].at[c, half], row0, num_rows, bm,
                                         h_bars, True, bar0)
                            plgpu.barrier_wait(s_bar.at[p])
                            if h_cp_async:
                                _common.cp_async_stage_done(0)
                                plgpu.commit_smem()  # every thread's rows, to all of them
                            else:
                                load(h_gate, h_smem[0].at[c, 0], row0, num_rows, bm, h_bars,
                                     False, bar0)
                        with jax.named_scope("epilogue"):
                            _dswiglu_and_store(
                                da, s_smem.at[p], tile(h_smem, c, 0), tile(h_smem, c, 1),
                                tile(ap_smem, c), ds_smem.at[c], dh_out, ap_out,
                                ds_out.at[mi, ni * cons + c], c0, n, row0, num_rows, bm,
                                ep_cols, activation,
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
        plgpu.Barrier(num_arrivals=cons, num_barriers=stages),  # empty
        plgpu.Barrier(num_barriers=2),  # ids
        plgpu.Barrier(num_barriers=2),  # scores
        # H boxes: per ladder box, the gate and up halves (each in 64-column slabs if swizzled)
        plgpu.Barrier(num_arrivals=2 * (bn // 64 if swizzled else 1),
                      num_barriers=cons * num_ladder),
        plgpu.Barrier(num_arrivals=cons),  # consumers done with the item's K loop
        plgpu.Barrier(num_arrivals=cons),  # consumers done with the epilogue's tiles
        *([_common.cp_async_stage_barriers(stages)] if stage_bars else []),
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
