"""Routing kernels (Pallas, Triton backend): top-K selection, per-block expert histograms
and local ranks in one pass over the selection scores.

The scores are computed by the same jnp expressions as the reference router (so the
kernel compares bit-identical values) and ranked in the total order `jax.lax.top_k` uses
(-0.0 < +0.0, NaN above +inf), through an order-preserving map of the float bits to int32.
Ties go to the lower expert index, as in `jax.lax.top_k`. So the kernel selects exactly the
experts the reference selects.

`topk_blocks(scores, k)` returns, for each token, its K experts in ascending expert order,
the rank of each (token, expert) pair among the pairs of the same expert in the token's
block (how many earlier tokens of the block chose that expert), and each block's expert
histogram. A prefix sum over the blocks then places every pair in the grouped order
(`plan_kernels.topk_plan_from_scores`).

Interpret mode (`interpret=True`) runs the same kernel body on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# Elements of one [block_t, E] tile a program holds; keeps registers per thread bounded.
_TILE_ELEMS = 8192
_INT32_MIN = -(2**31)


def next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def block_tokens(num_experts: int) -> int:
    """Tokens per program: a power of two in [16, 128] with `block_t * E_pad <= 8192`."""
    return max(16, min(128, _TILE_ELEMS // next_pow2(num_experts)))


def total_order_key(x: jax.Array) -> jax.Array:
    """i32 key whose signed order is the IEEE total order of the f32 `x` (lax.top_k's order)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _topk_block_kernel(
    scores_ref, experts_ref, local_rank_ref, counts_ref, *,
    k: int, num_tokens: int, num_experts: int, block_t: int, e_pad: int, k_pad: int,
):
    """One block of `block_t` tokens: top-K, ascending-order experts, local ranks, histogram."""
    b = pl.program_id(0)
    row0 = b * block_t
    rows = row0 + jnp.arange(block_t, dtype=jnp.int32)  # [bt]
    cols = jnp.arange(e_pad, dtype=jnp.int32)  # [ep]
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    scores = plt.load(
        scores_ref.at[pl.ds(row0, block_t), pl.ds(0, e_pad)],
        mask=row_ok[:, None] & col_ok[None, :], other=0.0,
    )  # f32[bt, ep]
    key = total_order_key(scores)  # i32[bt, ep]
    col_b = jnp.broadcast_to(cols[None, :], (block_t, e_pad))
    available = jnp.broadcast_to(col_ok[None, :], (block_t, e_pad))
    chosen = jnp.zeros((block_t, e_pad), jnp.bool_)
    for _ in range(k):  # K rounds of "largest key, lowest index among equals"
        best = jnp.max(jnp.where(available, key, _INT32_MIN), axis=1)  # [bt]
        cand = available & (key == best[:, None])
        idx = jnp.min(jnp.where(cand, col_b, e_pad), axis=1)  # [bt]
        pick = col_b == idx[:, None]
        chosen = chosen | pick
        available = available & jnp.logical_not(pick)
    chosen = chosen & row_ok[:, None]
    chosen_i = chosen.astype(jnp.int32)
    # Pairs of the same expert from earlier tokens of this block (exclusive prefix over t).
    local_rank = jnp.cumsum(chosen_i, axis=0) - chosen_i  # [bt, ep]
    # Position of each chosen expert among the token's K, in ascending expert order.
    slot = jnp.cumsum(chosen_i, axis=1) - chosen_i  # [bt, ep]
    kcol = jnp.arange(k_pad, dtype=jnp.int32)[None, :]  # [1, kp]
    experts = jnp.zeros((block_t, k_pad), jnp.int32)
    ranks = jnp.zeros((block_t, k_pad), jnp.int32)
    for j in range(k):
        at_j = chosen & (slot == j)
        e_j = jnp.sum(jnp.where(at_j, col_b, 0), axis=1)  # [bt]
        r_j = jnp.sum(jnp.where(at_j, local_rank, 0), axis=1)
        experts = jnp.where(kcol == j, e_j[:, None], experts)
        ranks = jnp.where(kcol == j, r_j[:, None], ranks)
    out_mask = row_ok[:, None] & (kcol < k)
    plt.store(experts_ref.at[pl.ds(row0, block_t), pl.ds(0, k_pad)], experts, mask=out_mask)
    plt.store(local_rank_ref.at[pl.ds(row0, block_t), pl.ds(0, k_pad)], ranks, mask=out_mask)
    plt.store(
        counts_ref.at[b, pl.ds(0, e_pad)], jnp.sum(chosen_i, axis=0), mask=col_ok
    )


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def topk_blocks(scores: jax.Array, k: int, *, interpret: bool = False):
    """Top-K per token with the block statistics that place the pairs in grouped order.

    Args:
      scores: f32[T, E] selection scores (ranked in IEEE total order; ties -> lower index).
      k: experts per token, 1 <= k <= E.
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      experts i32[T, K]: each token's experts in ascending order.
      local_rank i32[T, K]: for pair (t, e), how many tokens of t's block before t chose e.
      block_counts i32[NB, E]: pairs per expert in each block of `block_tokens(E)` tokens.
    """
    num_tokens, num_experts = scores.shape
    block_t = block_tokens(num_experts)
    num_blocks = pl.cdiv(num_tokens, block_t)
    kernel = functools.partial(
        _topk_block_kernel, k=k, num_tokens=num_tokens, num_experts=num_experts,
        block_t=block_t, e_pad=next_pow2(num_experts), k_pad=next_pow2(k),
    )
    out_shape = (
        jax.ShapeDtypeStruct((num_tokens, k), jnp.int32),
        jax.ShapeDtypeStruct((num_tokens, k), jnp.int32),
        jax.ShapeDtypeStruct((num_blocks, num_experts), jnp.int32),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_blocks,),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_topk_blocks",
    )(scores.astype(jnp.float32))
