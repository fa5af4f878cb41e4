"""Per-row expert outputs in `block_m`-aligned chunks: the down-proj side of the EP overlap.

`chunked_row_ffn(x, plan, w_gate_up, w_down, chunk_rows=S)` returns
`Y[g] = act(x[tok[g]] @ W1[e(g)] + b1[e(g)]) @ W2[e(g)] + b2[e(g)]` for every grouped row `g`
of the plan (the expert biases are optional, `act` is a `SwiGLU` spec),
*unweighted and not aggregated*, as `[C, S, d]`: chunk `c` holds grouped rows
`[c*S, (c+1)*S)`. The up-proj runs once over all rows; the down-proj runs once per chunk,
so a caller can start sending chunk `c` (e.g. an expert-parallel combine) while chunk
`c+1` is still being computed, and XLA's scheduler is free to overlap the two.

Why `block_m`-aligned: the down-proj kernel cuts its row tiles at every multiple of
`block_m` and at every expert boundary (`kernels._common.aligned_tile_meta`). With `S` a
multiple of `block_m`, the tiles of the chunks are exactly the tiles of the whole
down-proj, so chunking adds kernel launches but no partial tiles
(`benchmarks/ep.py --down-proj-chunking` measures that cost on one GPU).

The backward is not chunked: it is the minimal-activation backward of `moe_ffn` (the
kernels' on `mosaic`/`interpret`, `ops.minimal_backward` on `xla`), over residuals X and H.
It needs each token to own at most one row (true for the rows an expert-parallel shard
receives: each received row is its own token), because it turns `dY[g]` into the
cotangent of token `tok[g]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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


def chunk_block_m(backend: str, d: int, n: int) -> int:
    """Row alignment of the chunks: the down-proj kernel's `block_m` (8 on `xla`)."""
    if backend == "xla":
        return XLA_CHUNK_ALIGN
    from pallas_moe.kernels.moe_forward import ForwardConfig

    return ForwardConfig.for_shape(d, n).down.block_m


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


def chunk_group_sizes(group_sizes: jax.Array, chunk_rows: int, num_chunks: int) -> jax.Array:
    """i32[C, E]: rows of each expert inside grouped rows `[c*S, (c+1)*S)`."""
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)  # [E]
    starts = ends - group_sizes
    lo = jnp.arange(num_chunks, dtype=jnp.int32)[:, None] * chunk_rows  # [C, 1]
    return jnp.clip(jnp.minimum(ends, lo + chunk_rows) - jnp.maximum(starts, lo), 0, None)


def _identity_plan(group_sizes: jax.Array, rows: int) -> DispatchPlan:
    """A plan over `rows` tokens where grouped row r is token r with weight 1."""
    ids = jnp.arange(rows, dtype=jnp.int32)
    return DispatchPlan(
        token_ids=ids, scores=jnp.ones((rows,), jnp.float32), group_sizes=group_sizes,
        is_token_choice=jnp.ones((rows,), bool), rows_by_token=ids,
        token_row_offsets=jnp.arange(rows + 1, dtype=jnp.int32),
    )


def _forward_xla(x, plan, w_gate_up, w_down, biases, chunk_rows, num_chunks, activation):
    """(y [C, S, d], h [P, 2n]) with the roundings of `moe_ffn_xla`."""
    dtype = x.dtype
    d = x.shape[1]
    two_n = w_gate_up.shape[2]
    b_gate_up, b_down = biases

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
    a = jnp.pad(a, ((0, num_chunks * chunk_rows - plan.capacity), (0, 0)))
    sizes = chunk_group_sizes(plan.group_sizes, chunk_rows, num_chunks)  # [C, E]
    chunks = []
    for c in range(num_chunks):
        a_c = a[c * chunk_rows:(c + 1) * chunk_rows]  # [S, n]

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


def _forward_kernels(x, plan, w_gate_up, w_down, biases, chunk_rows, num_chunks, interpret,
                     activation):
    """(y [C, S, d], h [P, 2n]): one up-proj kernel, then one down-proj kernel per chunk."""
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.down_proj import down_proj
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.up_proj import up_proj

    d, n = w_down.shape[2], w_down.shape[1]
    config = ForwardConfig.for_shape(d, n, num_sms=4 if interpret else None)
    bm = config.down.block_m
    if chunk_rows % bm:
        raise ValueError(f"chunk_rows={chunk_rows} must be a multiple of the down-proj block_m={bm}.")
    b_gate_up, b_down = biases
    h, a = up_proj(
        x, plan.token_ids, plan.group_sizes, w_gate_up, config=config.up, interpret=interpret,
        meta=_common.tile_meta(plan.group_sizes, plan.token_ids, config.up.block_m),
        pad_a_rows_to=chunk_rows, bias=b_gate_up, activation=activation,
    )  # a [ceil(P/S)*S, n] = [C*S, n]
    sizes = chunk_group_sizes(plan.group_sizes, chunk_rows, num_chunks)  # [C, E]
    chunks = []
    for c in range(num_chunks):
        with jax.named_scope(down_proj_scope(c)):
            chunks.append(down_proj(
                a[c * chunk_rows:(c + 1) * chunk_rows], sizes[c], w_down, config=config.down,
                interpret=interpret, capacity=chunk_rows,
                meta=_common.aligned_tile_meta(sizes[c], chunk_rows, bm), bias=b_down,
            ))
    return jnp.stack(chunks), h


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _chunked(x, plan, w_gate_up, w_down, biases, chunk_rows, num_chunks, backend, activation):
    return _chunked_fwd(
        x, plan, w_gate_up, w_down, biases, chunk_rows, num_chunks, backend, activation
    )[0]


def _chunked_fwd(x, plan, w_gate_up, w_down, biases, chunk_rows, num_chunks, backend, activation):
    if backend == "xla":
        y, h = _forward_xla(x, plan, w_gate_up, w_down, biases, chunk_rows, num_chunks, activation)
    else:
        y, h = _forward_kernels(
            x, plan, w_gate_up, w_down, biases, chunk_rows, num_chunks,
            interpret=backend == "interpret", activation=activation,
        )
    return y, (x, h, plan, w_gate_up, w_down, biases)


def _chunked_bwd(chunk_rows, num_chunks, backend, activation, residuals, grad_y):
    x, h, plan, w_gate_up, w_down, (b_gate_up, b_down) = residuals
    grad_y = grad_y.reshape(num_chunks * chunk_rows, -1)[: plan.capacity]  # [P, d] grouped rows
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
    return dx, cot_plan, dw_gate_up, dw_down, d_biases


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_row_ffn(
    x: jax.Array,
    plan: DispatchPlan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    chunk_rows: int,
    backend: str = "auto",
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
) -> jax.Array:
    """Unweighted per-row expert outputs, in aligned chunks of grouped rows.

    Args:
      x: [T, d] tokens.
      plan: a `DispatchPlan` over T tokens in which every token owns at most one row (the
        backward relies on it); scores are ignored (the output is unweighted).
      w_gate_up: [E, d, 2n]; w_down: [E, n, d]; same dtype as x.
      chunk_rows: static S, a multiple of the down-proj's `block_m` (`chunk_block_m`).
      backend: as `pm.moe_ffn` ("auto", "mosaic", "interpret" or "xla").
      b_gate_up, b_down: optional [E, 2n] and [E, d] expert biases, x's dtype (as `moe_ffn`).
      activation: the `SwiGLU` spec (as `moe_ffn`).

    Returns:
      [C, S, d] in x.dtype with C = ceil(P / S): `out[c, j] = Y[c*S + j]` for grouped rows
      below `sum(group_sizes)`; other rows are unspecified (zero on `xla`). Differentiable
      in x, both weights and the biases given.
    """
    check_moe_inputs(x, plan, w_gate_up, w_down)
    check_expert_biases(x, w_gate_up, b_gate_up, b_down)
    activation = check_activation(activation)
    backend = resolve_backend(backend, x, w_down)
    block_m = chunk_block_m(backend, x.shape[1], w_down.shape[1])
    if chunk_rows <= 0 or chunk_rows % block_m:
        raise ValueError(
            f"chunk_rows must be a positive multiple of the down-proj block_m={block_m}, got {chunk_rows}."
        )
    num_chunks = -(-plan.capacity // chunk_rows)
    # The VJP returns cotangents typed like its inputs (see `pallas_moe._vma`).
    present = [b for b in (b_gate_up, b_down) if b is not None]
    x, w_gate_up, w_down, *present = vary_together(x, w_gate_up, w_down, *present)
    if b_gate_up is not None:
        b_gate_up, *present = present
    if b_down is not None:
        (b_down,) = present
    return _chunked(
        x, plan, w_gate_up, w_down, (b_gate_up, b_down), chunk_rows, num_chunks, backend,
        activation,
    )
