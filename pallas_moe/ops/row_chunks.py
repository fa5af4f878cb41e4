"""Per-row expert outputs in chunks of grouped rows: the down-proj side of the EP overlap.

`chunked_row_ffn(x, plan, w_gate_up, w_down, num_chunks=C)` returns
`Y[g] = act(x[tok[g]] @ W1[e(g)] + b1[e(g)]) @ W2[e(g)] + b2[e(g)]` for every grouped row `g`
of the plan (the expert biases are optional, `act` is a `SwiGLU` spec),
*unweighted and not aggregated*, as `[C, S, d]`: chunk `c` holds grouped rows
`[r_c, r_{c+1})` (`row_bounds`) at rows `[0, r_{c+1} - r_c)`. The up-proj runs once over all
rows; the down-proj runs once per chunk, so a caller can start sending chunk `c` (e.g. an
expert-parallel combine) while chunk `c+1` is still being computed, and XLA's scheduler is
free to overlap the two.

Where the chunks are cut (`RowChunking`): at boundaries of the down-proj kernel's row
tiles, which it cuts at every multiple of `block_m` and every expert boundary
(`kernels._common.aligned_tile_meta`). So the chunks' tiles are exactly the whole
down-proj's tiles (the same bits) and chunking adds kernel calls, not partial tiles. Each
chunk's call walks its range of the whole plan's tiles and reads the whole A
(`kernels._common.TileChunks`), so no chunk needs a slice of A or metadata of its own. The
bounds depend on the plan: each chunk but the last holds a whole number of the persistent
kernel's waves of work items (`kernels._common.wave_chunk_bounds`), so no chunk but the last
ends on a partial wave, and the chunks are balanced by work, not by the buffer's capacity
(an EP shard's receive buffer is mostly padding). `benchmarks/chunked_down_proj.py`
measures the cost on one GPU; `auto_num_chunks` picks a count from the work.

The backward is not chunked: it is the minimal-activation backward of `moe_ffn` (the
kernels' on `mosaic`/`interpret`, `ops.minimal_backward` on `xla`), over residuals X and H.
It needs each token to own at most one row (true for the rows an expert-parallel shard
receives: each received row is its own token), because it turns `dY[g]` into the
cotangent of token `tok[g]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_moe._checks import check_positive_int
from pallas_moe._vma import vary_together
from pallas_moe.ops.activation import SwiGLU, check_activation
from pallas_moe.ops.minimal_backward import moe_ffn_backward
from pallas_moe.ops.mosaic import plan_cotangent
from pallas_moe.ops.moe_ffn import check_expert_biases, check_moe_inputs, resolve_backend
from pallas_moe.ops.xla import scan_row_tiles
from pallas_moe.routing.plan import DispatchPlan

XLA_BLOCK_M = 128  # row tile of the xla backend (as `moe_ffn_xla`)
# The xla backend's tiles start at each expert's first row, so its chunks need no
# alignment to them; 8 rows keeps chunk slices sublane-aligned.
XLA_CHUNK_ALIGN = 8


def down_proj_scope(chunk: int) -> str:
    """Named scope of chunk `chunk`'s down-proj (the schedule checks find it by name)."""
    return f"down_proj_chunk{chunk}"


def chunk_layout(num_rows: int, num_chunks: int, block_m: int) -> tuple[int, int]:
    """(chunk rows S, number of chunks C) splitting `num_rows` rows into aligned chunks.

    S is the smallest multiple of `block_m` with `num_chunks * S >= num_rows`; C is
    `ceil(num_rows / S)` (at most `num_chunks`, so no chunk is statically empty).
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}.")
    blocks = -(-num_rows // block_m)
    size = max(1, -(-blocks // num_chunks)) * block_m
    return size, max(1, -(-num_rows // size))


def chunk_group_sizes(group_sizes: jax.Array, row_bounds: jax.Array) -> jax.Array:
    """i32[C, E]: rows of each expert inside grouped rows `[row_bounds[c], row_bounds[c+1])`."""
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)  # [E]
    starts = ends - group_sizes
    lo, hi = row_bounds[:-1, None], row_bounds[1:, None]  # [C, 1]
    return jnp.clip(jnp.minimum(ends, hi) - jnp.maximum(starts, lo), 0, None).astype(jnp.int32)


# "auto" chunk count (`auto_num_chunks`). Each chunk's down-proj call costs a fixed time on
# top of its waves (launch, ramp and drain of the persistent kernel), while the whole
# down-proj's time grows with its FLOPs. Fitted on the H100 (session 5,
# benchmarks/RESULTS.md, `benchmarks/chunked_down_proj.py`): 3.6 us per call at 7b-ep8 and
# 5.9 us at 30b-ep8, where the whole down-proj runs at ~570 TFLOP/s (137 GFLOP in 240 us).
# A chunk beyond the first is worth its call when the added time stays under 5% of the
# whole: (C - 1) * 6 us <= 0.05 * FLOPs / 570 TFLOP/s, i.e. one more chunk per ~70 GFLOP
# (measured at 30b-ep8: 2 chunks +0.9%, 4 chunks +6.4%).
AUTO_FLOPS_PER_EXTRA_CHUNK = 70e9
# More chunks also mean more combine collectives, each with its own latency.
AUTO_MAX_CHUNKS = 4


def auto_num_chunks(rows: int, d: int, n: int) -> int:
    """Chunks for a down-proj of about `rows` grouped rows of width `n` -> `d`: one, plus one
    per `AUTO_FLOPS_PER_EXTRA_CHUNK` of its `2 * rows * n * d` FLOPs, at most
    `AUTO_MAX_CHUNKS`. So each extra chunk's fixed cost stays under 5% of the whole
    down-proj on an H100 (the constant's comment says how it was derived)."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}.")
    flops = 2.0 * rows * n * d
    return int(min(AUTO_MAX_CHUNKS, 1 + flops // AUTO_FLOPS_PER_EXTRA_CHUNK))


@dataclasses.dataclass(frozen=True)
class RowChunking:
    """Where the chunked down-proj cuts a plan's grouped rows (static; the bounds are per plan).

    Attributes:
      capacity: P, the plan's row capacity.
      num_chunks: C, kernel calls (at most the count asked for: `chunk_layout`).
      rows: S, rows of each chunk's output buffer: the equal split of P
        (`chunk_layout`) plus room to move each bound by a wave of tiles.
      block_m: the down-proj's row tile (8 on xla); chunk bounds are tile boundaries.
      items_per_tile: the down-proj's work items per row tile (its column blocks; 1 on xla).
      wave: work items one wave of the persistent kernel runs (its CTAs; 1 on xla).
    """

    capacity: int
    num_chunks: int
    rows: int
    block_m: int
    items_per_tile: int
    wave: int

    @classmethod
    def for_shape(cls, backend: str, d: int, n: int, capacity: int, num_chunks: int) -> "RowChunking":
        """The chunking of a plan of `capacity` rows for the down-proj `[n] -> [d]` that
        `backend` ("xla", "mosaic" or "interpret", resolved) runs, in at most `num_chunks`."""
        if backend == "xla":
            block_m, items_per_tile, wave = XLA_CHUNK_ALIGN, 1, 1
        else:
            from pallas_moe.kernels.moe_forward import ForwardConfig

            down = ForwardConfig.for_shape(d, n, num_sms=4 if backend == "interpret" else None).down
            block_m, items_per_tile, wave = down.tile_rows, d // down.block_n, down.num_sms
        rows, count = chunk_layout(capacity, num_chunks, block_m)
        if count > 1:  # a bound may move up to a wave of tiles and a block from the equal split
            rows += (-(-wave // items_per_tile) + 1) * block_m
        return cls(capacity, count, rows, block_m, items_per_tile, wave)

    def bounds(self, group_sizes: jax.Array) -> jax.Array:
        """i32[C+1] row bounds of the chunks for one plan's `group_sizes` i32[E] (vmappable)."""
        from pallas_moe.kernels import _common

        meta = _common.aligned_tile_meta(group_sizes, self.capacity, self.block_m)
        return _common.wave_chunk_bounds(
            meta, self.num_chunks, self.rows, items_per_tile=self.items_per_tile, wave=self.wave
        )


def grouped_rows(chunked: jax.Array, row_bounds: jax.Array, num_rows: int) -> jax.Array:
    """[num_rows, ...]: grouped rows `[0, num_rows)` read back from chunks.

    Args:
      chunked: [C, S, ...] chunks as `chunked_row_ffn` returns them.
      row_bounds: i32[C+1] their bounds.
      num_rows: static; rows past `row_bounds[C]` read unspecified chunk rows.
    """
    num_chunks, chunk_rows = chunked.shape[:2]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # Grouped row g is row g - r_c of chunk c, the first chunk whose end is past g.
    chunk = jnp.minimum(jnp.searchsorted(row_bounds[1:], rows, side="right"), num_chunks - 1)
    offset = jnp.clip(rows - row_bounds[chunk], 0, chunk_rows - 1)
    return chunked[chunk, offset]


def _identity_plan(group_sizes: jax.Array, rows: int) -> DispatchPlan:
    """A plan over `rows` tokens where grouped row r is token r with weight 1."""
    ids = jnp.arange(rows, dtype=jnp.int32)
    return DispatchPlan(
        token_ids=ids, scores=jnp.ones((rows,), jnp.float32), group_sizes=group_sizes,
        is_token_choice=jnp.ones((rows,), bool), rows_by_token=ids,
        token_row_offsets=jnp.arange(rows + 1, dtype=jnp.int32),
    )


def _forward_xla(x, plan, w_gate_up, w_down, biases, row_bounds, chunking, activation):
    """(y [C, S, d], h [P, 2n]) with the roundings of `moe_ffn_xla`."""
    dtype = x.dtype
    d = x.shape[1]
    two_n = w_gate_up.shape[2]
    b_gate_up, b_down = biases
    num_chunks, chunk_rows = chunking.num_chunks, chunking.rows

    def up_step(h, rows, valid, tok, s, e):  # [c, bm] x4, [c]
        hc = jnp.einsum("cmd,cdf->cmf", x[tok], w_gate_up[e], preferred_element_type=jnp.float32)
        if b_gate_up is not None:
            hc = hc + b_gate_up[e][:, None, :].astype(jnp.float32)
        rows = jnp.where(valid, rows, plan.capacity)  # invalid slots are dropped
        return h.at[rows.reshape(-1)].set(hc.astype(dtype).reshape(-1, two_n), mode="drop")

    h = scan_row_tiles(
        plan, up_step, jnp.zeros((plan.capacity, two_n), dtype), block_m=XLA_BLOCK_M, tiles_per_step=8
    )  # [P, 2n]
    a = activation(h).astype(dtype)  # [P, n]
    # Chunk c starts at most c*S rows in, so every [r_c, r_c + S) slice is in bounds.
    a = jnp.pad(a, ((0, num_chunks * chunk_rows - plan.capacity), (0, 0)))
    sizes = chunk_group_sizes(plan.group_sizes, row_bounds)  # [C, E]
    chunks = []
    for c in range(num_chunks):
        a_c = jax.lax.dynamic_slice_in_dim(a, row_bounds[c], chunk_rows)  # [S, n]

        def down_step(y, rows, valid, tok, s, e, a_c=a_c):
            yc = jnp.einsum("cmn,cnd->cmd", a_c[rows], w_down[e], preferred_element_type=jnp.float32)
            if b_down is not None:
                yc = yc + b_down[e][:, None, :].astype(jnp.float32)
            rows = jnp.where(valid, rows, chunk_rows)
            return y.at[rows.reshape(-1)].set(yc.astype(dtype).reshape(-1, d), mode="drop")

        with jax.named_scope(down_proj_scope(c)):
            chunks.append(scan_row_tiles(
                _identity_plan(sizes[c], chunk_rows), down_step, jnp.zeros((chunk_rows, d), dtype),
                block_m=XLA_BLOCK_M, tiles_per_step=8,
            ))
    return jnp.stack(chunks), h


def _forward_kernels(x, plan, w_gate_up, w_down, biases, row_bounds, chunking, interpret,
                     activation):
    """(y [C, S, d], h [P, 2n]): one up-proj kernel, then one down-proj kernel per chunk, each
    over its range of the whole plan's tiles (`TileChunks`) and the whole A."""
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.down_proj import down_proj
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.up_proj import up_proj

    d, n = w_down.shape[2], w_down.shape[1]
    config = ForwardConfig.for_shape(d, n, num_sms=4 if interpret else None)
    bm = config.down.block_m
    b_gate_up, b_down = biases
    h, a = up_proj(
        x, plan.token_ids, plan.group_sizes, w_gate_up, config=config.up, interpret=interpret,
        meta=_common.tile_meta(plan.group_sizes, plan.token_ids, config.up.tile_rows),
        pad_a_rows_to=bm, bias=b_gate_up, activation=activation,
    )  # a [ceil(P/bm)*bm, n]: the down-proj loads whole aligned row blocks
    meta = _common.aligned_tile_meta(plan.group_sizes, plan.capacity, bm)
    chunks = _common.tile_chunks(meta, row_bounds, chunking.rows)
    out = []
    for c in range(chunking.num_chunks):
        with jax.named_scope(down_proj_scope(c)):
            out.append(down_proj(
                a, plan.group_sizes, w_down, config=config.down, interpret=interpret,
                meta=meta, capacity=plan.capacity, chunks=chunks, chunk=c, bias=b_down,
            ))
    return jnp.stack(out), h


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _chunked(x, plan, w_gate_up, w_down, biases, row_bounds, chunking, backend, activation):
    return _chunked_fwd(
        x, plan, w_gate_up, w_down, biases, row_bounds, chunking, backend, activation
    )[0]


def _chunked_fwd(x, plan, w_gate_up, w_down, biases, row_bounds, chunking, backend, activation):
    if backend == "xla":
        y, h = _forward_xla(x, plan, w_gate_up, w_down, biases, row_bounds, chunking, activation)
    else:
        y, h = _forward_kernels(
            x, plan, w_gate_up, w_down, biases, row_bounds, chunking,
            interpret=backend == "interpret", activation=activation,
        )
    return y, (x, h, plan, w_gate_up, w_down, biases, row_bounds)


def _chunked_bwd(chunking, backend, activation, residuals, grad_y):
    x, h, plan, w_gate_up, w_down, (b_gate_up, b_down), row_bounds = residuals
    grad_y = grouped_rows(grad_y, row_bounds, plan.capacity)  # [P, d]
    # Each token owns at most one row, so dY of grouped row g is the cotangent of token
    # tok[g]; padding rows are dropped (their index points past the end).
    target = jnp.where(plan.row_is_valid, plan.token_ids, x.shape[0])
    grad_out = jnp.zeros(x.shape, grad_y.dtype).at[target].set(grad_y, mode="drop")  # [T, d]
    unit = plan.with_scores(plan.row_is_valid.astype(jnp.float32))  # Y is unweighted
    with_biases = b_gate_up is not None or b_down is not None
    options = dict(activation=activation)
    if with_biases:  # the backward's contract: b_down (zeros if absent) asks for db1, db2
        num_experts, _, d = w_down.shape
        options["b_down"] = b_down if b_down is not None else jnp.zeros((num_experts, d), x.dtype)
    if backend == "xla":
        grads = moe_ffn_backward(x, h, unit, w_gate_up, w_down, grad_out, **options)
    else:
        from pallas_moe.kernels.moe_backward import moe_backward

        grads = moe_backward(
            x, h, unit, w_gate_up, w_down, grad_out, interpret=backend == "interpret", **options
        )
    dx, _, dw_gate_up, dw_down = grads[:4]
    d_biases = (None, None)
    if with_biases:
        db_gate_up, db_down = grads[4:]
        d_biases = (
            None if b_gate_up is None else db_gate_up.astype(b_gate_up.dtype),
            None if b_down is None else db_down,
        )
    cot_plan = plan_cotangent(plan, jnp.zeros_like(plan.scores))
    return dx, cot_plan, dw_gate_up, dw_down, d_biases, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_row_ffn(
    x: jax.Array,
    plan: DispatchPlan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    num_chunks: int,
    backend: str = "auto",
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
    row_bounds: jax.Array | None = None,
) -> jax.Array:
    """Unweighted per-row expert outputs, in chunks of grouped rows cut at row tiles.

    Args:
      x: [T, d] tokens.
      plan: a `DispatchPlan` over T tokens in which every token owns at most one row (the
        backward relies on it); scores are ignored (the output is unweighted).
      w_gate_up: [E, d, 2n]; w_down: [E, n, d]; same dtype as x.
      num_chunks: static, the most down-proj calls; `C = RowChunking.num_chunks` of them
        (fewer when the capacity has fewer `block_m` row blocks).
      backend: as `pm.moe_ffn` ("auto", "mosaic", "interpret" or "xla").
      b_gate_up, b_down: optional [E, 2n] and [E, d] expert biases, x's dtype (as `moe_ffn`).
      activation: the `SwiGLU` spec (as `moe_ffn`).
      row_bounds: optional i32[C+1], `RowChunking.bounds(plan.group_sizes)` when a caller
        has it already (the EP layer computes every shard's); computed here if None.

    Returns:
      [C, S, d] in x.dtype (S = `RowChunking.rows`): `out[c, j] = Y[row_bounds[c] + j]` for
      `j < row_bounds[c+1] - row_bounds[c]`; other rows are unspecified (zero on `xla`).
      Differentiable in x, both weights and the biases given.
    """
    check_moe_inputs(x, plan, w_gate_up, w_down)
    check_expert_biases(x, w_gate_up, b_gate_up, b_down)
    activation = check_activation(activation)
    backend = resolve_backend(backend, x, w_down)
    num_chunks = check_positive_int("num_chunks", num_chunks)
    chunking = RowChunking.for_shape(backend, x.shape[1], w_down.shape[1], plan.capacity, num_chunks)
    if row_bounds is None:
        row_bounds = chunking.bounds(plan.group_sizes)
    elif row_bounds.shape != (chunking.num_chunks + 1,) or row_bounds.dtype != jnp.int32:
        raise ValueError(
            f"row_bounds must be i32[{chunking.num_chunks + 1}] (RowChunking.bounds), got "
            f"{row_bounds.dtype}{list(row_bounds.shape)}."
        )
    # The VJP returns cotangents typed like its inputs (see `pallas_moe._vma`).
    present = [b for b in (b_gate_up, b_down) if b is not None]
    x, w_gate_up, w_down, *present = vary_together(x, w_gate_up, w_down, *present)
    if b_gate_up is not None:
        b_gate_up, *present = present
    if b_down is not None:
        (b_down,) = present
    return _chunked(
        x, plan, w_gate_up, w_down, (b_gate_up, b_down), row_bounds, chunking, backend,
        activation,
    )
