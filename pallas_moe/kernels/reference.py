"""Pure-jnp references of the forward kernels (same math, same rounding points).

Each reference computes what its kernel computes on the real rows of a plan; rows past
`sum(group_sizes)` (padding) are returned as zeros here, while the kernels leave them
unwritten, so tests compare real rows only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_moe.numerics import round_to
from pallas_moe.ops.activation import SwiGLU


def _row_expert(group_sizes: jax.Array, capacity: int) -> jax.Array:
    """i32[P] expert of each grouped row; E for padding rows."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(capacity, dtype=jnp.int32)
    return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)


def up_proj_reference(
    x: jax.Array,
    token_ids: jax.Array,
    group_sizes: jax.Array,
    w_gate_up: jax.Array,
    bias: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
) -> tuple[jax.Array, jax.Array]:
    """H = X[tok] @ W1[e] + b1[e] (fp32, bf16 out); A = act(H_gate, H_up) from bf16 H.

    `bias`: optional [E, 2n]. Returns (h bf16 [P, 2n], a bf16 [P, n]); padding rows are zero.
    """
    capacity = token_ids.shape[0]
    num_experts = w_gate_up.shape[0]
    expert = _row_expert(group_sizes, capacity)  # [P]
    valid = expert < num_experts
    clamped = jnp.minimum(expert, num_experts - 1)  # padding rows read the last expert
    xg = x[token_ids].astype(jnp.float32)  # [P, d]
    w = w_gate_up[clamped].astype(jnp.float32)  # [P, d, 2n]
    h = jnp.einsum("pd,pdf->pf", xg, w, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        h = h + bias[clamped].astype(jnp.float32)
    h = jnp.where(valid[:, None], h, 0.0).astype(x.dtype)
    a = activation(h).astype(x.dtype)
    return h, a


def down_proj_reference(
    a: jax.Array, group_sizes: jax.Array, w_down: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
    """Y = A @ W2[e] + b2[e] (fp32 accumulate, bf16 out), bf16 [P, d]; padding rows are zero.

    `bias`: optional [E, d]."""
    capacity = a.shape[0]
    num_experts = w_down.shape[0]
    expert = _row_expert(group_sizes, capacity)
    valid = expert < num_experts
    clamped = jnp.minimum(expert, num_experts - 1)  # padding rows read the last expert
    w = w_down[clamped].astype(jnp.float32)  # [P, n, d]
    y = jnp.einsum("pn,pnd->pd", a.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias[clamped].astype(jnp.float32)
    return jnp.where(valid[:, None], y, 0.0).astype(a.dtype)


def fp8_grouped_matmul_reference(
    a: jax.Array,
    group_sizes: jax.Array,
    w_t: jax.Array,
    row_scales: jax.Array,
    col_scales: jax.Array,
    *,
    gated: bool,
    capacity: int | None = None,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """The grouped GEMM's 8-bit mode: `acc = A[r] @ W[e]^T` (e4m3 products with f32 sums, or
    int8 products with exact s32 sums rounded once to f32, as the int8 wgmma's accumulator),
    then `acc * row_scales[r] * col_scales[e, j]`; with `gated`, SwiGLU of the (gate, up)
    halves rounded to out_dtype first (`_common.swiglu_epilogue`'s order).

    Args:
      a: e4m3 or int8 [P_a, K]; w_t: a's dtype [E, N, K] ([E, 2N, K] gated); row_scales f32
      [>= P]; col_scales f32 [E, N] ([E, 2N]); capacity: P (default a.shape[0]).

    Returns:
      [P, N] in out_dtype; padding rows are zero.
    """
    capacity = a.shape[0] if capacity is None else capacity
    num_experts = w_t.shape[0]
    expert = _row_expert(group_sizes, capacity)
    valid = expert < num_experts
    e = jnp.minimum(expert, num_experts - 1)
    # Grouped rows are contiguous per expert: a ragged dot, no per-row weight copy.
    if a.dtype == jnp.int8:  # exact s32 sums, then one rounding to f32
        acc = jax.lax.ragged_dot(
            a[:capacity], jnp.swapaxes(w_t, 1, 2), group_sizes.astype(jnp.int32),
            preferred_element_type=jnp.int32,
        ).astype(jnp.float32)
    else:
        acc = jax.lax.ragged_dot(
            a[:capacity].astype(jnp.float32), jnp.swapaxes(w_t, 1, 2).astype(jnp.float32),
            group_sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST,
        )  # [P, N]; rows past sum(group_sizes) are 0
    deq = fp8_epilogue_reference(acc, row_scales[:capacity], col_scales[e], gated=gated,
                                 out_dtype=out_dtype)
    return jnp.where(valid[:, None], deq, 0.0).astype(out_dtype)


def fp8_epilogue_reference(acc, row_scales, col_scales, *, gated: bool, out_dtype=jnp.bfloat16):
    """The fp8 grouped GEMM's epilogue on given f32 sums: `acc * row_scales[r] * col_scales[r, j]`,
    then (gated) SwiGLU of the (gate, up) halves rounded to out_dtype first.

    Args:
      acc: f32 [R, N] ([R, 2N] gated); row_scales: f32 [R]; col_scales: f32 [R, N] ([R, 2N]),
        each row's expert's column scales.

    Returns:
      [R, N] in out_dtype.
    """
    deq = acc * row_scales[:, None] * col_scales
    if gated:
        n = deq.shape[1] // 2
        hg, hu = round_to(deq[:, :n], out_dtype), round_to(deq[:, n:], out_dtype)
        deq = hg * jax.nn.sigmoid(hg) * hu
    return deq.astype(out_dtype)


def aggregate_reference(
    y: jax.Array,
    rows_by_token: jax.Array,
    token_row_offsets: jax.Array,
    scores: jax.Array | None,
    out_dtype=None,
) -> jax.Array:
    """O[t] = sum over j in [off[t], off[t+1]) of s[r_j] * Y[r_j], r_j = rows_by_token[j].

    fp32 accumulate in CSR (ascending expert) order; `scores=None` means weight 1.
    """
    num_tokens = token_row_offsets.shape[0] - 1
    capacity = rows_by_token.shape[0]
    pos = jnp.arange(capacity, dtype=jnp.int32)
    token_of_pos = jnp.searchsorted(token_row_offsets[1:], pos, side="right")  # [P]
    valid = pos < token_row_offsets[-1]
    yr = y[rows_by_token].astype(jnp.float32)  # [P, d]
    if scores is not None:
        yr = yr * scores[rows_by_token].astype(jnp.float32)[:, None]
    yr = jnp.where(valid[:, None], yr, 0.0)
    out = jnp.zeros((num_tokens, y.shape[1]), jnp.float32)
    out = out.at[jnp.where(valid, token_of_pos, num_tokens)].add(yr, mode="drop")
    return out.astype(out_dtype or y.dtype)


def moe_forward_reference(
    x, plan, w_gate_up, w_down, *, b_gate_up=None, b_down=None, activation=SwiGLU()
):
    """(out [T, d], h [P, 2n]) through the three references (optional expert biases)."""
    h, a = up_proj_reference(
        x, plan.token_ids, plan.group_sizes, w_gate_up, b_gate_up, activation
    )
    y = down_proj_reference(a, plan.group_sizes, w_down, b_down)
    out = aggregate_reference(y, plan.rows_by_token, plan.token_row_offsets, plan.scores, x.dtype)
    return out, h
