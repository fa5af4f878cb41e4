"""Routing kernels (Pallas, Triton backend): top-K selection, per-block expert histograms
and local ranks in one pass over the selection scores; token rounding's per-expert selection.

The scores are computed by the same formulas as the reference router (`routing.formulas`,
so the kernel compares bit-identical values) and ranked in the total order `jax.lax.top_k` uses
(-0.0 < +0.0, NaN above +inf), through an order-preserving map of the float bits to int32.
Ties go to the lower expert index, as in `jax.lax.top_k`. So the kernel selects exactly the
experts the reference selects.

`topk_blocks(scores, k)` returns, for each token, its K experts in ascending expert order,
the rank of each (token, expert) pair among the pairs of the same expert in the token's
block (how many earlier tokens of the block chose that expert), and each block's expert
histogram. A prefix sum over spans of blocks (`span_bases`) and `place_pairs`, which adds
the counts of the span's earlier blocks, then place every pair in the grouped order.

`topk_small(scores, k)` does all of that for a batch of at most `SMALL_BATCH_TOKENS` tokens
in one program (selection, histogram, its prefix sum, every pair's grouped row), where the
block path's kernels are mostly launch; `topk_plan` takes it for batches of at most
`small_batch_limit()` tokens (`SMALL_BATCH_DEFAULT`, where it measured faster on an H200;
`small_batch_routing()` sets another limit).

`select_largest(keys, count, prefer_high)` is token rounding's per-expert selection: per
row (an expert's list of keys), the indices of its `count` largest keys in ascending order,
by a bitwise radix select over the row held in registers (`token_rounding.py` runs it on the
chunk maxima, then on the best chunks' tokens). `place_rounded` then places the kept top-K
pairs and the added pairs of the token-rounding plan at their rows and CSR slots.

Why the top-K kernel reads XLA's scores instead of computing them from the logits (which
would save the [T, E] probability write and one read: XLA's softmax pass, 11.7 us of the
plan's ~68 us at T=32768, E=128, K=8 on the H100). The plan must select exactly the dense
reference's experts, and the reference ranks f32 probabilities:
- Ranking the raw logits is not the same selection: softmax is monotonic but not strictly,
  distinct logits can round to equal probabilities (exp(-1e-8) == 1.0 in f32), and those tie
  and go to the lower expert where the logits would pick the higher one
  (`tests/test_routing_impls.py::test_probability_ties_are_not_logit_ties`).
- The kernel would have to compute the reference's probability bits, `routing.formulas`'
  exact operations (a pairwise tree of adds in its order, XLA's `exp` and division); a
  Triton reduction or `exp` need not round the same way.
So the scores come from the reference's own formulas (`routing.formulas`, whose bits do not
depend on the program around them), and the kernel ranks their bits. "topk_softmax" ranks
the logits, as the reference does, and then no probability pass runs at all in a top-K plan.

Interpret mode (`interpret=True`) runs the same kernel body on the CPU.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_moe._vma import pallas_call
from pallas_moe.routing.topk import total_order_key

_INT32_MIN = -(2**31)


def next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def block_tokens(num_experts: int) -> int:
    """Tokens per top-K program: 8, or 2 past 128 experts.

    Measured on an H100 (benchmarks/RESULTS.md, routing sweeps): the kernel is fastest with
    small blocks and about 8 elements of the [block_t, E] tile per thread; 64-token blocks
    were 5x slower (registers spill). Past 128 experts fewer warps per token pay (each of
    the K rounds reduces across the warps of a row): at 16384 x 512 x 10 the whole top-K
    plan took 117.9 us with 2-token blocks against 123.4 with 4 (session 7; 1-token blocks
    are faster alone but their per-block histograms cost more than they save).
    """
    return 8 if next_pow2(num_experts) <= 128 else 2


def block_warps(num_experts: int) -> int:
    """Warps per top-K program: about 8 tile elements per thread, 1 to 8 warps."""
    return max(1, min(8, block_tokens(num_experts) * next_pow2(num_experts) // 256))


def _chosen_experts(key, col_b, col_ok, k: int):
    """bool[rows, ep]: each row's K experts by `key` (i32[rows, ep]), in K rounds of
    "largest key, lowest index among equals" (`jax.lax.top_k`'s choice). `col_b` holds
    the column indices, `col_ok` (bool[ep]) the real experts."""
    e_pad = key.shape[1]
    available = jnp.broadcast_to(col_ok[None, :], key.shape)
    for _ in range(k):
        best = jnp.max(jnp.where(available, key, _INT32_MIN), axis=1)  # [rows]
        cand = available & (key == best[:, None])
        idx = jnp.min(jnp.where(cand, col_b, e_pad), axis=1)  # [rows]
        available = available & (col_b != idx[:, None])
    return jnp.logical_not(available) & col_ok[None, :]


def _topk_block_kernel(
    scores_ref, experts_ref, local_rank_ref, counts_ref, *,
    k: int, num_tokens: int, num_experts: int, block_t: int, e_pad: int,
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
    chosen = _chosen_experts(key, col_b, col_ok, k) & row_ok[:, None]  # [bt, ep]
    chosen_i = chosen.astype(jnp.int32)
    # Pairs of the same expert from earlier tokens of this block (exclusive prefix over t).
    local_rank = jnp.cumsum(chosen_i, axis=0) - chosen_i  # [bt, ep]
    # Position of each chosen expert among the token's K, in ascending expert order; the
    # chosen entries are scattered straight to their [T, K] slots.
    slot = jnp.cumsum(chosen_i, axis=1) - chosen_i  # [bt, ep]
    # Masked lanes point one past the end: never written on the GPU, dropped in interpret
    # mode (where a masked lane aliasing a real index could overwrite it).
    flat = jnp.where(chosen, rows[:, None] * k + slot, num_tokens * k)  # [bt, ep]
    plt.store(experts_ref.at[flat], col_b, mask=chosen)
    plt.store(local_rank_ref.at[flat], local_rank, mask=chosen)
    plt.store(counts_ref.at[b, pl.ds(0, e_pad)], jnp.sum(chosen_i, axis=0), mask=col_ok)


def _place_kernel(
    experts_ref, local_rank_ref, weights_ref, span_base_ref, counts_ref,
    token_ids_ref, scores_ref, rows_ref, *,
    k: int, num_tokens: int, num_experts: int, block_t: int, route_block_t: int, k_pad: int,
    span_blocks: int,
):
    """Grouped row of each of a block's pairs; scatters token ids and scores to it."""
    row0 = pl.program_id(0) * block_t
    rows = row0 + jnp.arange(block_t, dtype=jnp.int32)  # [bt]
    kcol = jnp.arange(k_pad, dtype=jnp.int32)  # [kp]
    ok = (rows < num_tokens)[:, None] & (kcol < k)[None, :]  # [bt, kp]
    # Masked lanes point one past the end (see `_topk_block_kernel`).
    pair = jnp.where(ok, rows[:, None] * k + kcol[None, :], num_tokens * k)  # [bt, kp]
    experts = plt.load(experts_ref.at[pair], mask=ok, other=0)
    local_rank = plt.load(local_rank_ref.at[pair], mask=ok, other=0)
    weights = plt.load(weights_ref.at[pair], mask=ok, other=0.0)
    block = (rows // route_block_t)[:, None]  # [bt, 1] the pair's top-K block
    span = block // span_blocks
    # The span's base, then the pairs of the same expert in the span's earlier blocks.
    grouped = plt.load(span_base_ref.at[span * num_experts + experts], mask=ok, other=0)
    for i in range(span_blocks - 1):
        earlier = span * span_blocks + i  # [bt, 1]
        before = ok & (earlier < block)
        grouped += plt.load(counts_ref.at[jnp.where(before, earlier * num_experts + experts, 0)],
                            mask=before, other=0)
    grouped = grouped + local_rank  # [bt, kp]
    grouped = jnp.where(ok, grouped, num_tokens * k)
    plt.store(rows_ref.at[pair], grouped, mask=ok)
    plt.store(token_ids_ref.at[grouped], jnp.broadcast_to(rows[:, None], pair.shape), mask=ok)
    plt.store(scores_ref.at[grouped], weights, mask=ok)


def _params(num_warps: int):
    return plt.CompilerParams(num_warps=num_warps, num_stages=1)


@functools.partial(jax.jit, static_argnames=("k", "interpret", "block_t", "num_warps"))
def topk_blocks(
    scores: jax.Array, k: int, *, interpret: bool = False, block_t: int | None = None,
    num_warps: int | None = None,
):
    """Top-K per token with the block statistics that place the pairs in grouped order.

    Args:
      scores: f32[T, E] selection scores (ranked in IEEE total order; ties -> lower index).
      k: experts per token, 1 <= k <= E.
      interpret: run the kernel in Pallas interpret mode (CPU).
      block_t: tokens per program (a power of two; default `block_tokens(E)`).
      num_warps: warps per program (default `block_warps(E)`).

    Returns:
      experts i32[T, K]: each token's experts in ascending order.
      local_rank i32[T, K]: for pair (t, e), how many tokens of t's block before t chose e.
      block_counts i32[NB, E]: pairs per expert in each block of `block_t` tokens.
    """
    num_tokens, num_experts = scores.shape
    block_t = block_t or block_tokens(num_experts)
    num_warps = num_warps or block_warps(num_experts)
    num_blocks = pl.cdiv(num_tokens, block_t)
    kernel = functools.partial(
        _topk_block_kernel, k=k, num_tokens=num_tokens, num_experts=num_experts,
        block_t=block_t, e_pad=next_pow2(num_experts),
    )
    out_shape = (
        jax.ShapeDtypeStruct((num_tokens * k,), jnp.int32),
        jax.ShapeDtypeStruct((num_tokens * k,), jnp.int32),
        jax.ShapeDtypeStruct((num_blocks, num_experts), jnp.int32),
    )
    experts, local_rank, counts = pallas_call(
        kernel, out_shape=out_shape, grid=(num_blocks,), compiler_params=_params(num_warps),
        interpret=interpret, name="moe_topk_blocks",
    )(scores.astype(jnp.float32))
    return experts.reshape(num_tokens, k), local_rank.reshape(num_tokens, k), counts


# `topk_small` routes a batch of at most this many tokens in one program: at decode sizes
# each of the block path's kernels (top-K blocks, three XLA prefix sums, placement) is
# mostly launch (~1-2 us each on an H200, session 33's T = 1 profile).
SMALL_BATCH_TOKENS = 32
# The largest batch `topk_plan`'s kernel path routes with `topk_small` by default. Measured
# on an H200 (session 41, Qwen3-30B-A3B router, E = 128, K = 8, routing alone, GPU time):
# 6.7 against the block path's 8.5 us at T = 1, 7.5 against 9.3 at T = 8, but 10.9 against
# 10.2 at T = 32 (one program's serial [T, E] work grows with T). `small_batch_routing`
# sets another limit for a trace.
SMALL_BATCH_DEFAULT = 8
_small_batch_limit = SMALL_BATCH_DEFAULT


def small_batch_limit() -> int:
    """Batches of at most this many tokens take `topk_small` (0: none; by default
    `SMALL_BATCH_DEFAULT`)."""
    return _small_batch_limit


@contextlib.contextmanager
def small_batch_routing(max_tokens: int = SMALL_BATCH_TOKENS):
    """Within the block, `topk_plan`'s kernel path routes batches of at most `max_tokens`
    tokens with `topk_small` (read when a function is traced: trace inside the block); 0
    turns it off. Outside any block the limit is `SMALL_BATCH_DEFAULT`."""
    global _small_batch_limit
    if not isinstance(max_tokens, int) or not 0 <= max_tokens <= SMALL_BATCH_TOKENS:
        raise ValueError(f"max_tokens must be an int in [0, {SMALL_BATCH_TOKENS}], got {max_tokens!r}.")
    previous, _small_batch_limit = _small_batch_limit, max_tokens
    try:
        yield
    finally:
        _small_batch_limit = previous


def _topk_small_kernel(scores_ref, experts_ref, rows_ref, sizes_ref, token_ids_ref, pairs_ref,
                       offsets_ref, *, k: int, num_tokens: int, num_experts: int, t_pad: int,
                       e_pad: int, o_pad: int):
    """The whole batch in one program: top-K, the expert histogram, its prefix sum, each
    pair's grouped row (expert start plus the pairs of the same expert from earlier
    tokens), each grouped row's token and pair, and the plan's CSR offsets."""
    rows = jnp.arange(t_pad, dtype=jnp.int32)  # [Tp]
    cols = jnp.arange(e_pad, dtype=jnp.int32)  # [Ep]
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    scores = plt.load(
        scores_ref.at[pl.ds(0, t_pad), pl.ds(0, e_pad)],
        mask=row_ok[:, None] & col_ok[None, :], other=0.0,
    )  # f32[Tp, Ep]
    col_b = jnp.broadcast_to(cols[None, :], (t_pad, e_pad))
    chosen = _chosen_experts(total_order_key(scores), col_b, col_ok, k) & row_ok[:, None]
    chosen_i = chosen.astype(jnp.int32)
    sizes = jnp.sum(chosen_i, axis=0)  # [Ep] pairs per expert
    starts = jnp.cumsum(sizes) - sizes  # [Ep] first grouped row of each expert
    grouped = starts[None, :] + jnp.cumsum(chosen_i, axis=0) - chosen_i  # [Tp, Ep]
    slot = jnp.cumsum(chosen_i, axis=1) - chosen_i  # position among the token's K, ascending
    # Masked lanes point one past the end (see `_topk_block_kernel`).
    flat = jnp.where(chosen, rows[:, None] * k + slot, num_tokens * k)
    plt.store(experts_ref.at[flat], col_b, mask=chosen)
    plt.store(rows_ref.at[flat], grouped, mask=chosen)
    plt.store(sizes_ref.at[pl.ds(0, e_pad)], sizes, mask=col_ok)
    at_row = jnp.where(chosen, grouped, num_tokens * k)
    plt.store(token_ids_ref.at[at_row], jnp.broadcast_to(rows[:, None], grouped.shape), mask=chosen)
    plt.store(pairs_ref.at[at_row], rows[:, None] * k + slot, mask=chosen)
    # Each token holds K rows: offsets[t] = t * K (written here rather than by an XLA iota
    # fusion, one launch fewer per decode step).
    tokens = jnp.arange(o_pad, dtype=jnp.int32)
    plt.store(offsets_ref.at[pl.ds(0, o_pad)], tokens * k, mask=tokens <= num_tokens)


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def topk_small(scores: jax.Array, k: int, *, interpret: bool = False):
    """Top-K of a small batch and each pair's grouped row, in one program.

    The same selection as `topk_blocks` (IEEE total order, ties to the lower expert) and
    the same rows as `place_pairs` (grouped by expert, by token within an expert), for
    `T <= SMALL_BATCH_TOKENS`, where the block path's five kernels cost more than they do.

    Args:
      scores: f32[T, E] selection scores.
      k: experts per token, 1 <= k <= E.
      interpret: run the kernel in Pallas interpret mode (CPU).

    Returns:
      experts i32[T, K] (each token's experts, ascending), rows i32[T, K] (each pair's
      grouped row), group_sizes i32[E], token_ids i32[T*K] (each grouped row's token),
      pair_ids i32[T*K] (each grouped row's pair `t * K + slot`, the inverse of `rows`), and
      offsets i32[T + 1] (the plan's CSR offsets, `t * K`). `pair_ids` lets the caller
      put the pairs' weights in grouped order with a gather, which XLA fuses into the
      weights' own formula, instead of a scatter into zeros (two launches; decode steps
      are launch-bound).
    """
    num_tokens, num_experts = scores.shape
    if num_tokens > SMALL_BATCH_TOKENS:
        raise ValueError(
            f"topk_small routes at most {SMALL_BATCH_TOKENS} tokens in one program, got "
            f"scores with {num_tokens} rows; use topk_blocks and place_pairs."
        )
    t_pad, e_pad = next_pow2(num_tokens), next_pow2(num_experts)
    kernel = functools.partial(
        _topk_small_kernel, k=k, num_tokens=num_tokens, num_experts=num_experts,
        t_pad=t_pad, e_pad=e_pad, o_pad=next_pow2(num_tokens + 1),
    )
    pairs = jax.ShapeDtypeStruct((num_tokens * k,), jnp.int32)
    experts, rows, sizes, token_ids, pair_ids, offsets = pallas_call(
        kernel,
        out_shape=(
            pairs, pairs, jax.ShapeDtypeStruct((num_experts,), jnp.int32), pairs, pairs,
            jax.ShapeDtypeStruct((num_tokens + 1,), jnp.int32),
        ),
        grid=(1,),
        compiler_params=_params(max(1, min(8, t_pad * e_pad // 256))),
        interpret=interpret,
        name="moe_topk_small",
    )(scores.astype(jnp.float32))
    return (experts.reshape(num_tokens, k), rows.reshape(num_tokens, k), sizes, token_ids,
            pair_ids, offsets)


PLACE_SPAN_BLOCKS = 8  # top-K blocks per span of `place_pairs`' bases


def place_pairs(
    experts: jax.Array, local_rank: jax.Array, weights: jax.Array, span_base: jax.Array,
    block_counts: jax.Array, *, block_t: int, interpret: bool = False, num_warps: int = 4,
):
    """Places every (token, expert) pair at its grouped row, in one kernel.

    Pair (t, e) of top-K block `b = t // block_t` goes to row
    `span_base[b // S, e] + sum(block_counts[S * (b // S):b, e]) + local_rank[t, e]`, with
    `S = PLACE_SPAN_BLOCKS`: the prefix sum over blocks is XLA's only over spans of S blocks,
    and the kernel adds the at most S - 1 counts before the pair's block in its span (a
    prefix sum over every block, `[T / block_t, E]`, cost XLA ~24 us at T=16384, E=512 on
    the H100, more than the kernel).

    Args:
      experts, local_rank: i32[T, K] from `topk_blocks`.
      weights: f32[T, K] router weight of each pair (differentiable: the cotangent of the
        scattered scores is gathered back).
      span_base: i32[NS, E] first grouped row of each (span, expert); `span_bases`.
      block_counts: i32[NB, E] pairs per (block, expert), from `topk_blocks`.
      block_t: the `topk_blocks` block size.

    Returns:
      token_ids i32[T*K], scores f32[T*K] (grouped order), rows i32[T, K] (each pair's row).
    """
    return _place(experts, local_rank, weights, span_base, block_counts, block_t, interpret,
                  num_warps)


def span_bases(block_counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(group_sizes i32[E], span_base i32[NS, E]) from the per-block expert histograms
    i32[NB, E] of `topk_blocks`: each expert's group start plus its pairs in earlier spans
    of `PLACE_SPAN_BLOCKS` blocks (what `place_pairs` adds block counts to)."""
    num_blocks, num_experts = block_counts.shape
    num_spans = pl.cdiv(num_blocks, PLACE_SPAN_BLOCKS)
    padded = jnp.pad(block_counts, ((0, num_spans * PLACE_SPAN_BLOCKS - num_blocks), (0, 0)))
    span_counts = jnp.sum(
        padded.reshape(num_spans, PLACE_SPAN_BLOCKS, num_experts), axis=1, dtype=jnp.int32
    )  # [NS, E]
    through_span = jnp.cumsum(span_counts, axis=0, dtype=jnp.int32)  # [NS, E] inclusive
    group_sizes = through_span[-1]  # [E]: each expert's total, the scan's last row
    starts = jnp.cumsum(group_sizes, dtype=jnp.int32) - group_sizes  # [E]
    return group_sizes, through_span - span_counts + starts[None, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _place(experts, local_rank, weights, span_base, block_counts, block_t, interpret, num_warps):
    return _place_fwd(experts, local_rank, weights, span_base, block_counts, block_t, interpret,
                      num_warps)[0]


def _place_fwd(experts, local_rank, weights, span_base, block_counts, block_t, interpret,
               num_warps):
    num_tokens, k = experts.shape
    place_t = max(16, min(256, 2048 // next_pow2(k)))  # tokens per program
    kernel = functools.partial(
        _place_kernel, k=k, num_tokens=num_tokens, num_experts=span_base.shape[1],
        block_t=place_t, route_block_t=block_t, k_pad=next_pow2(k),
        span_blocks=PLACE_SPAN_BLOCKS,
    )
    p = num_tokens * k
    token_ids, scores, rows = pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((p,), jnp.int32),
            jax.ShapeDtypeStruct((p,), jnp.float32),
            jax.ShapeDtypeStruct((p,), jnp.int32),
        ),
        grid=(pl.cdiv(num_tokens, place_t),),
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="moe_place_pairs",
    )(experts.reshape(-1), local_rank.reshape(-1), weights.reshape(-1).astype(jnp.float32),
      span_base.reshape(-1), block_counts.reshape(-1))
    rows = rows.reshape(num_tokens, k)
    return (token_ids, scores, rows), rows


def _place_bwd(block_t, interpret, num_warps, rows, cotangents):
    _, d_scores, _ = cotangents
    d_weights = d_scores[rows]  # [T, K]: the scatter's transpose is a gather
    return None, None, d_weights, None, None


_place.defvjp(_place_fwd, _place_bwd)


# ------------------------------------------------------------------ router probabilities


def _softmax_kernel(
    x_ref, out_ref, *, num_rows: int, width: int, w_pad: int, block_r: int, interpret: bool
):
    """Softmax over each of a block's rows: `exp(x - max) * (1 / sum)`.

    Compiled, the row maximum and sum are Triton's reductions (one order, fixed in the
    compiled kernel). Interpreted, the body is XLA ops, which would reorder a reduction per
    fusion, so it takes `formulas`' pairwise trees instead.
    """
    from pallas_moe.routing import formulas

    row_max, row_sum = (formulas.tree_max, formulas.tree_sum) if interpret else (
        functools.partial(jnp.max, axis=1, keepdims=True),
        functools.partial(jnp.sum, axis=1, keepdims=True),
    )
    row0 = pl.program_id(0) * block_r
    rows = row0 + jnp.arange(block_r, dtype=jnp.int32)
    cols = jnp.arange(w_pad, dtype=jnp.int32)
    ok = (rows < num_rows)[:, None] & (cols < width)[None, :]
    x = plt.load(x_ref.at[pl.ds(row0, block_r), pl.ds(0, w_pad)], mask=ok, other=-jnp.inf)
    unnormalized = jnp.exp(x - row_max(x))  # 0 in padding columns
    p = unnormalized * (1.0 / row_sum(unnormalized))
    plt.store(out_ref.at[pl.ds(row0, block_r), pl.ds(0, w_pad)], p, mask=ok)


def softmax_block_rows(width: int) -> int:
    """Rows per softmax program: about 2048 elements (16 per thread of 4 warps; untuned)."""
    return max(1, 2048 // next_pow2(width))


@functools.partial(jax.jit, static_argnames=("interpret",))
def softmax_rows(x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """f32[R, N] softmax over each row of f32[R, N], one Pallas kernel.

    The GPU's router probabilities (`routing.formulas.softmax`): one compiled kernel, so
    the same bits in every program that calls it, whatever XLA fuses around it (XLA's own
    softmax rounds its row sum by the fusion it lands in). Its row sum and division are
    Triton's (the order of its reduction, `div.full`), not XLA's.
    """
    num_rows, width = x.shape
    block_r = softmax_block_rows(width)
    kernel = functools.partial(
        _softmax_kernel, num_rows=num_rows, width=width, w_pad=next_pow2(width), block_r=block_r,
        interpret=interpret,
    )
    return pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, width), jnp.float32),
        grid=(pl.cdiv(num_rows, block_r),),
        compiler_params=_params(4),
        interpret=interpret,
        name="moe_router_softmax",
    )(x.astype(jnp.float32))


# ------------------------------------------------------------------ token-rounding selection

MAX_SELECT_LENGTH = 16384  # keys per list held in one program's registers (64 per thread)


def _select_kernel(
    keys_ref, count_ref, prefer_high_ref, out_ref, *,
    length: int, l_pad: int, max_count: int, m_pad: int, num_lists: int,
):
    """One list: the `count` largest keys, emitted as ascending list indices.

    A bitwise radix select (most significant bit first, 32 block reductions of the keys
    held in registers) finds the threshold: the count-th largest key `v`, and how many of
    the keys equal to `v` to take (`need`). Every key above `v` is taken and, of those equal
    to `v`, the `need` lowest indices (or, with `prefer_high`, the highest). A cumulative
    sum then gives each taken index its slot. One bit per pass keeps the working set to
    the [L] keys (a radix-16 pass would count a [L, 16] one-hot).
    """
    r = pl.program_id(0)
    idx = jnp.arange(l_pad, dtype=jnp.int32)  # [Lp]
    valid = idx < length
    key = plt.load(keys_ref.at[r, pl.ds(0, l_pad)], mask=valid, other=_INT32_MIN)  # i32[Lp]
    count = count_ref[r]
    prefer_high = prefer_high_ref[r]
    # Unsigned order of the signed keys: flip the sign bit (INT32_MIN -> 0). Padding lanes
    # count as 0 and are never taken (`valid` below); `count <= length` keeps the search
    # inside the real keys.
    ukey = key ^ jnp.int32(_INT32_MIN)
    prefix = jnp.int32(0)  # the threshold's bits found so far, in the unsigned order
    need = count  # keys still to take among those matching `prefix`
    for bit in range(31, -1, -1):
        high_bits = _as_int32((0xFFFFFFFF << (bit + 1)) & 0xFFFFFFFF)  # bits above `bit`
        match = (ukey & jnp.int32(high_bits)) == prefix  # [Lp]
        with_bit = jnp.sum((match & ((ukey & jnp.int32(_as_int32(1 << bit))) != 0)).astype(jnp.int32))
        take_bit = need <= with_bit  # the count-th largest has this bit set
        prefix = jnp.where(take_bit, prefix | jnp.int32(_as_int32(1 << bit)), prefix)
        need = jnp.where(take_bit, need, need - with_bit)
    threshold = prefix ^ jnp.int32(_INT32_MIN)  # back to a signed key
    equal = valid & (key == threshold)
    equal_i = equal.astype(jnp.int32)
    num_equal = jnp.sum(equal_i)
    skip = jnp.where(prefer_high != 0, num_equal - need, 0)  # equal keys passed over first
    tie_rank = jnp.cumsum(equal_i) - equal_i  # [Lp] rank among the equal keys, by index
    taken = valid & (count > 0) & (
        (key > threshold) | (equal & (tie_rank >= skip) & (tie_rank < skip + need))
    )
    taken_i = taken.astype(jnp.int32)
    slot = jnp.cumsum(taken_i) - taken_i  # [Lp]
    # Masked lanes point one past the end (see `_topk_block_kernel`).
    end = num_lists * max_count
    plt.store(out_ref.at[jnp.where(taken, r * max_count + slot, end)], idx, mask=taken)
    # Slots past `count` hold `length` (no index); disjoint from the slots written above.
    j = jnp.arange(m_pad, dtype=jnp.int32)
    empty = (j >= count) & (j < max_count)
    plt.store(out_ref.at[jnp.where(empty, r * max_count + j, end)],
              jnp.full((m_pad,), length, jnp.int32), mask=empty)


def _as_int32(v: int) -> int:
    """The int32 with the bits of `v` (an unsigned 32-bit value)."""
    return v - (1 << 32) if v >= 1 << 31 else v


def select_warps(length: int) -> int:
    """Warps per selection program: about 8 keys per thread, 1 to 8 warps (untuned)."""
    return max(1, min(8, next_pow2(length) // 256))


@functools.partial(jax.jit, static_argnames=("max_count", "interpret", "num_warps"))
def select_largest(
    keys: jax.Array, count: jax.Array, prefer_high: jax.Array, *, max_count: int,
    interpret: bool = False, num_warps: int | None = None,
) -> jax.Array:
    """Per list (row), the indices of its `count` largest keys, ascending.

    Ties at the threshold go to the lower index, or to the higher one where `prefer_high`.
    One program per row: the row is held in registers, so `L <= MAX_SELECT_LENGTH`.

    Args:
      keys: i32[R, L] keys (signed order).
      count: i32[R] keys to take per row, each in [0, min(L, max_count)].
      prefer_high: bool[R] tie rule per row.
      max_count: static output width M.
      interpret: run the kernel in Pallas interpret mode (CPU).
      num_warps: warps per program (default `select_warps(L)`).

    Returns:
      i32[R, M]: each row's taken indices in ascending order, then `L`.
    """
    num_lists, length = keys.shape
    if length > MAX_SELECT_LENGTH:
        raise ValueError(
            f"keys rows must hold at most {MAX_SELECT_LENGTH} keys (one program's registers), "
            f"got {length}."
        )
    if max_count == 0:
        return jnp.zeros((num_lists, 0), jnp.int32)
    kernel = functools.partial(
        _select_kernel, length=length, l_pad=next_pow2(length), max_count=max_count,
        m_pad=next_pow2(max_count), num_lists=num_lists,
    )
    out = pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_lists * max_count,), jnp.int32),
        grid=(num_lists,),
        compiler_params=_params(num_warps or select_warps(length)),
        interpret=interpret,
        name="moe_select_largest",
    )(keys.astype(jnp.int32), count.astype(jnp.int32), prefer_high.astype(jnp.int32))
    return out.reshape(num_lists, max_count)


# ------------------------------------------------------------------ token-rounding placement


def _count_below_in_lists(list_ref, list_id, value, ok, *, length: int):
    """i32[...]: entries < value in list `list_id` of a flat ref of ascending lists of
    `length` (a branchless binary search, as `token_rounding._count_below_by_search`)."""
    count = jnp.zeros(value.shape, jnp.int32)
    step = 1 << (length.bit_length() - 1)
    while step:
        probe = count + step
        at = jnp.where(ok, list_id * length + jnp.minimum(probe, length) - 1, 0)
        below = plt.load(list_ref.at[at], mask=ok, other=0) < value
        count = jnp.where((probe <= length) & below, probe, count)
        step //= 2
    return count


def _place_kept_kernel(
    experts_ref, rows_ref, weights_ref, dropped_ref, added_ref, tc_start_ref, new_start_ref,
    offsets_ref, added_below_ref, _token_ids_in, _scores_in, _is_tc_in, _by_token_in,
    token_ids_ref, scores_ref, is_tc_ref, by_token_ref, tc_row_ref, *,
    k: int, k_pad: int, num_tokens: int, block_t: int, max_change: int, capacity: int,
):
    """A block of tokens: each top-K pair's row after the drops and adds of its expert,
    the scatter of its token, weight and flag there, and its slot in the token's CSR list."""
    tok = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)  # [bt]
    kcol = jnp.arange(k_pad, dtype=jnp.int32)
    ok = (tok < num_tokens)[:, None] & (kcol < k)[None, :]  # [bt, kp]
    # Masked lanes point one past the end (see `_topk_block_kernel`).
    pair = jnp.where(ok, tok[:, None] * k + kcol[None, :], num_tokens * k)
    expert = plt.load(experts_ref.at[pair], mask=ok, other=0)
    token = jnp.broadcast_to(tok[:, None], pair.shape)
    if max_change:
        dropped_before = _count_below_in_lists(dropped_ref, expert, token, ok, length=max_change)
        at = jnp.where(ok, expert * max_change + jnp.minimum(dropped_before, max_change - 1), 0)
        kept = ok & (plt.load(dropped_ref.at[at], mask=ok, other=0) != token)
        added_before = _count_below_in_lists(added_ref, expert, token, ok, length=max_change)
    else:
        dropped_before = added_before = jnp.zeros(pair.shape, jnp.int32)
        kept = ok
    tc_row = (
        plt.load(new_start_ref.at[expert], mask=ok, other=0)
        + plt.load(rows_ref.at[pair], mask=ok, other=0)
        - plt.load(tc_start_ref.at[expert], mask=ok, other=0)
        - dropped_before + added_before
    )
    kept_i = kept.astype(jnp.int32)
    slot = (
        plt.load(offsets_ref.at[jnp.where(tok < num_tokens, tok, 0)], mask=tok < num_tokens, other=0)[:, None]
        + jnp.cumsum(kept_i, axis=1) - kept_i
        + plt.load(added_below_ref.at[pair], mask=ok, other=0)
    )  # [bt, kp]; a token's top-K experts are ascending
    row = jnp.where(kept, tc_row, capacity)
    plt.store(token_ids_ref.at[row], token, mask=kept)
    plt.store(scores_ref.at[row], plt.load(weights_ref.at[pair], mask=ok, other=0.0), mask=kept)
    plt.store(is_tc_ref.at[row], jnp.ones(pair.shape, jnp.int32), mask=kept)
    plt.store(by_token_ref.at[jnp.where(kept, slot, capacity)], tc_row, mask=kept)
    plt.store(tc_row_ref.at[pair], row, mask=ok)


def _place_added_kernel(
    added_ref, added_scores_ref, pair_tokens_ref, experts_ref, tc_row_ref, counts_ref,
    tc_start_ref, new_start_ref, offsets_ref, added_below_ref,
    _token_ids_in, _scores_in, _by_token_in,
    token_ids_ref, scores_ref, by_token_ref, added_row_ref, *,
    k: int, k_pad: int, num_tokens: int, num_experts: int, max_change: int, m_pad: int,
    capacity: int,
):
    """One expert's added rows: each lands after the expert's top-K tokens below it (a
    binary search in the top-K plan's rows of that expert) and its earlier added ones."""
    e = pl.program_id(0)
    j = jnp.arange(m_pad, dtype=jnp.int32)  # [mp]
    in_list = j < max_change
    end = num_experts * max_change
    at = jnp.where(in_list, e * max_change + j, end)
    tok = plt.load(added_ref.at[at], mask=in_list, other=num_tokens)
    is_added = in_list & (tok < num_tokens)
    safe_tok = jnp.where(is_added, tok, 0)
    start, count = tc_start_ref[e], counts_ref[e]
    # The expert's top-K tokens (ascending, rows [start, start + count)) below `tok`.
    below = jnp.zeros((m_pad,), jnp.int32)
    step = 1 << (num_tokens.bit_length() - 1)
    while step:
        probe = below + step
        read = jnp.where(is_added, start + jnp.minimum(probe, count) - 1, 0)
        lower = plt.load(pair_tokens_ref.at[jnp.maximum(read, 0)], mask=is_added, other=0) < tok
        below = jnp.where((probe <= count) & lower, probe, below)
        step //= 2
    added_row = new_start_ref[e] + below + j  # [mp]
    # The token's kept top-K experts below e, then its added experts below e.
    kcol = jnp.arange(k_pad, dtype=jnp.int32)
    ok = is_added[:, None] & (kcol < k)[None, :]
    pair = jnp.where(ok, safe_tok[:, None] * k + kcol[None, :], num_tokens * k)
    kept_below = (
        ok & (plt.load(experts_ref.at[pair], mask=ok, other=0) < e)
        & (plt.load(tc_row_ref.at[pair], mask=ok, other=capacity) < capacity)
    )
    slot = (
        plt.load(offsets_ref.at[safe_tok], mask=is_added, other=0)
        + jnp.sum(kept_below.astype(jnp.int32), axis=1)
        + plt.load(added_below_ref.at[at], mask=is_added, other=0)
    )
    row = jnp.where(is_added, added_row, capacity)
    plt.store(token_ids_ref.at[row], tok, mask=is_added)
    plt.store(scores_ref.at[row], plt.load(added_scores_ref.at[at], mask=is_added, other=0.0),
              mask=is_added)
    plt.store(by_token_ref.at[jnp.where(is_added, slot, capacity)], added_row, mask=is_added)
    plt.store(added_row_ref.at[at], row, mask=in_list)


def place_rounded(
    experts, rows, weights, pair_tokens, counts, target, dropped, added, added_scores,
    offsets, tc_added_below, added_added_below, *, capacity: int, interpret: bool = False,
):
    """Token rounding's placement: every kept top-K pair and every added pair at its grouped
    row, and each at its slot of its token's CSR list, in two kernels.

    Args:
      experts, rows: i32[T, K] the top-K pairs' experts (ascending per token) and rows.
      weights: f32[T, K] their weights (differentiable).
      pair_tokens: i32[T*K] the top-K plan's token ids (ascending within each expert).
      counts, target: i32[E] top-K and rounded rows per expert.
      dropped, added: i32[E, M] each expert's dropped / added tokens, ascending, then T.
      added_scores: f32[E, M] the added rows' weights (differentiable).
      offsets: i32[T] first CSR slot of each token (`token_row_offsets[:-1]`).
      tc_added_below: i32[T, K] added experts of the pair's token below its expert.
      added_added_below: i32[E, M] added experts of the added token below the expert.
      capacity: static row capacity P.

    Returns:
      token_ids i32[P], scores f32[P], is_token_choice bool[P], rows_by_token i32[P]:
      those of the plan, padding included (token 0, score 0, slots pointing at themselves).
    """
    return _place_rounded(
        experts, rows, weights, pair_tokens, counts, target, dropped, added, added_scores,
        offsets, tc_added_below, added_added_below, capacity, interpret,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(12, 13))
def _place_rounded(experts, rows, weights, pair_tokens, counts, target, dropped, added,
                   added_scores, offsets, tc_added_below, added_added_below, capacity, interpret):
    return _place_rounded_fwd(
        experts, rows, weights, pair_tokens, counts, target, dropped, added, added_scores,
        offsets, tc_added_below, added_added_below, capacity, interpret,
    )[0]


def _place_rounded_fwd(experts, rows, weights, pair_tokens, counts, target, dropped, added,
                       added_scores, offsets, tc_added_below, added_added_below, capacity,
                       interpret):
    num_tokens, k = experts.shape
    num_experts, max_change = added.shape
    counts = counts.astype(jnp.int32)
    target = target.astype(jnp.int32)
    tc_start = jnp.cumsum(counts, dtype=jnp.int32) - counts
    new_start = jnp.cumsum(target, dtype=jnp.int32) - target
    block_t = max(16, min(256, 2048 // next_pow2(k)))
    out = (
        jax.ShapeDtypeStruct((capacity,), jnp.int32),
        jax.ShapeDtypeStruct((capacity,), jnp.float32),
        jax.ShapeDtypeStruct((capacity,), jnp.int32),
        jax.ShapeDtypeStruct((capacity,), jnp.int32),
    )
    padding = (
        jnp.zeros((capacity,), jnp.int32), jnp.zeros((capacity,), jnp.float32),
        jnp.zeros((capacity,), jnp.int32), jnp.arange(capacity, dtype=jnp.int32),
    )  # what padding rows and slots hold; the kernels write the real ones
    flat_dropped = dropped.reshape(-1).astype(jnp.int32)
    flat_added = added.reshape(-1).astype(jnp.int32)
    if max_change == 0:  # the lists are empty: keep a one-entry ref to index
        flat_dropped = flat_added = jnp.full((1,), num_tokens, jnp.int32)
    token_ids, scores, is_tc, by_token, tc_row = pallas_call(
        functools.partial(
            _place_kept_kernel, k=k, k_pad=next_pow2(k), num_tokens=num_tokens,
            block_t=block_t, max_change=max_change, capacity=capacity,
        ),
        out_shape=out + (jax.ShapeDtypeStruct((num_tokens * k,), jnp.int32),),
        grid=(pl.cdiv(num_tokens, block_t),),
        input_output_aliases={9: 0, 10: 1, 11: 2, 12: 3},
        compiler_params=_params(4),
        interpret=interpret,
        name="moe_place_kept_pairs",
    )(experts.reshape(-1), rows.reshape(-1), weights.reshape(-1).astype(jnp.float32),
      flat_dropped, flat_added, tc_start, new_start, offsets.astype(jnp.int32),
      tc_added_below.reshape(-1).astype(jnp.int32), *padding)
    if max_change == 0:
        added_row = jnp.zeros((num_experts, 0), jnp.int32)
    else:
        token_ids, scores, by_token, added_row = pallas_call(
            functools.partial(
                _place_added_kernel, k=k, k_pad=next_pow2(k), num_tokens=num_tokens,
                num_experts=num_experts, max_change=max_change, m_pad=next_pow2(max_change),
                capacity=capacity,
            ),
            out_shape=(out[0], out[1], out[3],
                       jax.ShapeDtypeStruct((num_experts * max_change,), jnp.int32)),
            grid=(num_experts,),
            input_output_aliases={10: 0, 11: 1, 12: 2},
            compiler_params=_params(4),
            interpret=interpret,
            name="moe_place_added_pairs",
        )(flat_added, added_scores.reshape(-1).astype(jnp.float32), pair_tokens.astype(jnp.int32),
          experts.reshape(-1), tc_row, counts, tc_start, new_start, offsets.astype(jnp.int32),
          added_added_below.reshape(-1).astype(jnp.int32), token_ids, scores, by_token)
        added_row = added_row.reshape(num_experts, max_change)
    result = (token_ids, scores, is_tc != 0, by_token)
    return result, (tc_row.reshape(num_tokens, k), added_row)


def _place_rounded_bwd(capacity, interpret, residuals, cotangents):
    tc_row, added_row = residuals
    d_scores = cotangents[1]

    def gather(row):  # the scatter's transpose; rows at `capacity` were never written
        return jnp.where(row < capacity, d_scores[jnp.minimum(row, capacity - 1)], 0.0)

    return (None, None, gather(tc_row), None, None, None, None, None, gather(added_row),
            None, None, None)


_place_rounded.defvjp(_place_rounded_fwd, _place_rounded_bwd)
