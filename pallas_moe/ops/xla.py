"""The `xla` backend of `moe_ffn`: pure jnp, differentiable by plain autodiff.

It is the reference the Pallas kernels are checked against and the path for CPU and TPU.
Memory stays sane at training sizes: it walks the plan's row tiles (each inside one
expert's group) in a `lax.scan`, a few tiles per step, so it never builds `[E, P, d]` and
never calls `jax.lax.ragged_dot` (a dense fallback on GPU). Roundings mirror the kernels:
fp32 accumulation, `H`, `A` and `Y` rounded to the input dtype, fp32 aggregation in
ascending expert order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def moe_ffn_xla(
    x: jax.Array,
    plan: DispatchPlan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
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
        y = jnp.where(slot_is_row, y.astype(dtype).astype(jnp.float32) * s[..., None], 0.0)  # [c, bm, d]
        # Tiles go in ascending expert order and a token meets each expert once, so every
        # token's sum runs in ascending expert order, as in the aggregation kernel.
        return out.at[tok.reshape(-1)].add(y.reshape(-1, d))

    out = scan_row_tiles(
        plan, step, jnp.zeros((num_tokens, d), jnp.float32),
        block_m=block_m, tiles_per_step=tiles_per_step,
    )
    return out.astype(dtype)
