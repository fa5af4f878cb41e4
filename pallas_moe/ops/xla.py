"""The `xla` backend of `moe_ffn`: pure jnp, differentiable by plain autodiff.

It is the reference the Pallas kernels are checked against and the path for CPU and TPU.
Memory stays sane at training sizes: it walks the plan's row tiles (each inside one
expert's group) in a `lax.scan`, a few tiles per step, so it never builds `[E, P, d]` and
never calls `jax.lax.ragged_dot` (a dense fallback on GPU). Roundings mirror the kernels:
fp32 accumulation, `H`, `A` and `Y` rounded to the input dtype, and the aggregation of
`pallas_moe.numerics` (fp32 by default) in ascending expert order: the tiles of one scan
step are added one after another, and a tile holds each token at most once, so the order
never rests on how a scatter orders duplicate indices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_moe import numerics as nm
from pallas_moe._vma import vary, varying_axes
from pallas_moe.ops.activation import SwiGLU
from pallas_moe.routing.plan import DispatchPlan, tile_schedule


def swiglu(h: jax.Array) -> jax.Array:
    """silu(gate) * up for `h = [..., 2n]` with gate = `h[..., :n]`; computed in fp32."""
    return SwiGLU()(h)


def scan_row_tiles(plan: DispatchPlan, step, init, *, block_m: int, tiles_per_step: int):
    """Walks the plan's row tiles in ascending expert order, `tiles_per_step` per scan step.

    `step(carry, rows, valid, token, score, expert) -> carry` gets `rows`, `valid`, `token`,
    `score` of shape [c, bm] and `expert` of shape [c]. Invalid slots have row 0, token 0
    and score 0. Padding tiles (past the real ones) are empty and repeat the last expert.
    A `step` must mask invalid slots with a select (`jnp.where(valid, ...)`), never rely on
    the score of 0: NaN * 0 is NaN, so a NaN in token 0 or in the tile's expert would leak.
    """
    tiles = tile_schedule(plan.group_sizes, plan.capacity, block_m)
    num_tiles = tiles.max_tiles
    num_steps = -(-num_tiles // tiles_per_step)
    pad = num_steps * tiles_per_step - num_tiles

    rows = tiles.row_start[:, None] + jnp.arange(block_m, dtype=jnp.int32)[None, :]  # [nt, bm]
    valid = rows < tiles.row_end[:, None]  # [nt, bm]
    rows = jnp.where(valid, rows, 0)
    token = plan.token_ids[rows]  # [nt, bm]
    score = jnp.where(valid, plan.scores[rows], 0.0)  # [nt, bm]
    expert = tiles.expert  # [nt]
    if pad:
        rows, valid, token, score = (
            jnp.pad(a, ((0, pad), (0, 0))) for a in (rows, valid, token, score)
        )
        expert = jnp.pad(expert, (0, pad), mode="edge")

    def body(carry, inputs):
        return step(carry, *inputs), None

    reshape = lambda a: a.reshape(num_steps, tiles_per_step, *a.shape[1:])
    xs = tuple(map(reshape, (rows, valid, token, score, expert)))
    carry, _ = jax.lax.scan(body, _vary_like_step(body, init, xs), xs)
    return carry


def _vary_like_step(body, init, xs):
    """`init` cast to vary over the mesh axes the scan body's carry output varies over.

    Inside `shard_map(check_vma=True)` a scan's carry must keep one varying-axis type, but
    a zero init is invariant while the step mixes in varying tokens or weights. One
    abstract evaluation of the body finds the axes; elsewhere (no manual axes) this is a
    no-op.
    """
    first = jax.tree.map(lambda a: a[0], xs)
    out, _ = jax.eval_shape(body, init, first)
    return jax.tree.map(lambda c, o: vary(c, varying_axes(o)), init, out)


def add_tile_rows(
    out: jax.Array, tok: jax.Array, valid: jax.Array, s: jax.Array, y: jax.Array, aggregation: str
) -> jax.Array:
    """Adds each tile's weighted rows to their tokens' sums, tile after tile.

    Args:
      out: f32 [T, d] running sums.
      tok, valid, s: [c, bm] token, validity and score of each slot of c tiles (in
        ascending expert order; a tile holds a token at most once).
      y: [c, bm, d] expert outputs of the slots.
      aggregation: one of `pallas_moe.numerics.AGGREGATIONS`.

    Returns:
      f32 [T, d]; invalid slots are dropped, not added as zeros (that would turn a -0 sum
      into +0).
    """
    num_tokens = out.shape[0]
    for i in range(tok.shape[0]):
        idx = jnp.where(valid[i], tok[i], num_tokens)  # [bm]; out of range -> dropped
        c = nm.contribution(y[i], s[i], aggregation)  # f32 [bm, d]
        if aggregation == "fp32":
            out = out.at[idx].add(c, mode="drop")
        else:
            acc = out.at[idx].get(mode="fill", fill_value=0.0)
            out = out.at[idx].set(nm.accumulate(acc, c, aggregation), mode="drop")
    return out


def aggregate_rows(
    y: jax.Array,
    plan: DispatchPlan,
    aggregation: str = "fp32",
    *,
    rows_per_token: int | None = None,
    block_m: int = 128,
    tiles_per_step: int = 8,
) -> jax.Array:
    """`O[t] = sum over rows r of token t of s[r] * Y[r]`, ascending expert order, in jnp.

    The same sums as the aggregation kernel and `moe_ffn_xla`, for expert outputs computed
    elsewhere (the expert-parallel combine).

    Args:
      y: [P, d] expert outputs in the plan's grouped row order.
      plan: the plan the rows belong to (scores, CSR rows of each token).
      aggregation: one of `pallas_moe.numerics.AGGREGATIONS`.
      rows_per_token: static K when every token has exactly K rows (top-K plans): the
        sum then walks K gathered `[T, d]` slices instead of the row tiles.
      block_m, tiles_per_step: the row-tile walk otherwise (as `moe_ffn_xla`).

    Returns:
      f32 [T, d].
    """
    num_tokens, d = plan.num_tokens, y.shape[1]
    out = jnp.zeros((num_tokens, d), jnp.float32)
    if rows_per_token is not None:
        by_token = plan.rows_by_token[: num_tokens * rows_per_token].reshape(
            num_tokens, rows_per_token
        )  # [T, K], ascending expert order
        for k in range(rows_per_token):
            rows = by_token[:, k]
            out = nm.accumulate(out, nm.contribution(y[rows], plan.scores[rows], aggregation), aggregation)
        return out

    def step(out, rows, valid, tok, s, e):  # [c, bm] x4, [c]
        return add_tile_rows(out, tok, valid, s, y[rows], aggregation)

    return scan_row_tiles(plan, step, out, block_m=block_m, tiles_per_step=tiles_per_step)


def moe_ffn_xla(
    x: jax.Array,
    plan: DispatchPlan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
    aggregation: str = "fp32",
    block_m: int = 128,
    tiles_per_step: int = 8,
) -> jax.Array:
    """Gated MoE forward, `O[t] = sum_r s[r] * (act(X[tok[r]] @ W1[e] + b1[e]) @ W2[e] + b2[e])`.

    Args:
      x: [T, d] tokens.
      plan: dispatch plan over T tokens and E experts.
      w_gate_up: [E, d, 2n].
      w_down: [E, n, d].
      b_gate_up: optional [E, 2n] bias of the up-projection (added in fp32 before H is rounded).
      b_down: optional [E, d] bias of the down-projection (added in fp32 before Y is rounded).
      activation: the `SwiGLU` spec (default `silu(gate) * up`).
      aggregation: "fp32", "bf16_per_expert" or "bf16_scores" (`pallas_moe.numerics`).
      block_m: rows per tile.
      tiles_per_step: tiles batched in one scan step (their weights are gathered:
        `tiles_per_step * (d*2n + n*d)` elements live at once).

    Returns:
      [T, d] in x.dtype.
    """
    num_tokens, d = x.shape
    dtype = x.dtype

    def step(out, rows, valid, tok, s, e):  # [c, bm] x4, [c]
        slot_is_row = valid[..., None]  # [c, bm, 1]
        # Selects, not a multiply by the invalid slots' score of 0: a NaN/Inf in token 0 (the
        # slots' source) or in the tile's expert weights must not reach other tokens or experts,
        # in the forward or (through the selects' VJPs) in the gradients.
        xt = jnp.where(slot_is_row, x[tok], 0)  # [c, bm, d]
        h = jnp.einsum("cmd,cdf->cmf", xt, w_gate_up[e], preferred_element_type=jnp.float32)
        if b_gate_up is not None:
            h = h + b_gate_up[e][:, None, :].astype(jnp.float32)
        a = activation(h.astype(dtype)).astype(dtype)  # [c, bm, n]
        y = jnp.einsum("cmn,cnd->cmd", a, w_down[e], preferred_element_type=jnp.float32)
        if b_down is not None:
            y = y + b_down[e][:, None, :].astype(jnp.float32)
        # Tiles go in ascending expert order and a token meets each expert once, so every
        # token's sum runs in ascending expert order, as in the aggregation kernel.
        return add_tile_rows(out, tok, valid, s, y.astype(dtype), aggregation)

    out = scan_row_tiles(
        plan, step, jnp.zeros((num_tokens, d), jnp.float32),
        block_m=block_m, tiles_per_step=tiles_per_step,
    )
    return out.astype(dtype)
