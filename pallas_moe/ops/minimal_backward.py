"""The minimal-activation MoE backward (SonicMoE appendix; `docs/math.md`), in jnp.

Given only `X`, the saved `H = X[tok] @ W1[e] + b1[e]` and the plan, it computes every
gradient without `Y`, `dY` or a saved gathered `X`:

    dA'[r] = dO[tok[r]] @ W2[e]^T                      [P, n]
    A[r]   = act(H[r])                                 [P, n]  recomputed from H
    dS[r]  = <dA'[r], A[r]> + <dO[tok[r]], b2[e]>      [P]     router-score gradient
    dH[r]  = act'(H[r], s[r] * dA'[r])                 [P, 2n]
    A'[r]  = s[r] * A[r]                               [P, n]
    dW2[e] = A'[rows e]^T @ dO[tok[rows e]]            [E, n, d]
    dX[t]  = sum over rows r of t of dH[r] @ W1[e]^T   [T, d]
    dW1[e] = X[tok[rows e]]^T @ dH[rows e]             [E, d, 2n]
    db1[e] = sum over rows r of e of dH[r]             [E, 2n]  (expert biases only)
    db2[e] = sum over rows r of e of s[r] * dO[tok[r]] [E, d]   (expert biases only)

`act` is the `SwiGLU` spec (`silu(g) * u`, or gpt-oss's clamped variant) and `act'` its
gradient. This is the XLA path of the backward and the reference the backward kernels are
checked against. Roundings mirror the kernels: fp32 accumulation, `dH` and `A'` rounded to
the input dtype before they feed a GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_moe.numerics import round_to
from pallas_moe.ops.activation import SwiGLU
from pallas_moe.ops.xla import scan_row_tiles
from pallas_moe.routing.plan import DispatchPlan


def expert_bias_gradients(
    dh: jax.Array,
    plan: DispatchPlan,
    grad_out: jax.Array,
    b_down: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The expert-bias terms of the backward, from a computed dH (the kernel backward's).

        dS_b[r] = <dO[tok[r]], b2[e]>                     f32 [P]   (add to dS)
        db1[e]  = sum over rows r of e of dH[r]            f32 [E, 2n]
        db2[e]  = sum over rows r of e of s[r] * dO[tok[r]]   f32 [E, d]

    As three dense products over the plan, each one fixed-order XLA GEMM (no scatter adds,
    no atomics, so bitwise the same from run to run), with fp32 accumulation:

        db1  = onehot[P, E]^T @ dH[:P]     the real rows' experts, exact 0/1 in dH's dtype
        db2  = W[E, T] @ dO                W[e, t]: the score of token t's row of expert e
                                           (each (e, t) pair at most once), else 0
        dS_b = (dO @ b2^T)[tok[r], e(r)]   [T, E] products, one gathered per row

    Padding rows (unwritten in dH, possibly non-finite) are selected away before the GEMM.
    Unlike a per-expert walk, a non-finite value in one row of dH or one token of dO
    reaches every expert's db1 or db2 (it is multiplied by the others' zeros); such a
    gradient is non-finite anyway. What this replaces, a scan over the plan's 128-row tiles
    8 at a time, cast to fp32: in gpt-oss-20b's step on the H100 (session 50's breakdown,
    `benchmarks/step.py`) the XLA fusions launched once per scan step (36 launches each)
    took about 1.5 ms of the 13.1-ms step; these products take gpt-oss's step to 11.67 ms
    from 13.25 (session 51, paired; the bias gradients alone 3.8x faster).

    Args:
      dh: [P_pad, 2n] (P_pad >= P) dH in grouped row order, rounded to the compute dtype.
      plan: the plan with the scores the forward multiplied by.
      grad_out: [T, d] cotangent of the output (rounded to dH's dtype, as the kernels read it).
      b_down: [E, d] down-projection bias (zeros for a layer with only `b_gate_up`).

    Returns:
      (dS_b f32 [P] (0 on padding rows), db1 f32 [E, 2n], db2 f32 [E, d]).
    """
    num_experts = b_down.shape[0]
    capacity, num_tokens = plan.capacity, plan.num_tokens
    f32, highest = jnp.float32, jax.lax.Precision.HIGHEST
    valid = plan.row_is_valid  # [P]
    expert = jnp.where(valid, plan.expert_ids, num_experts)  # [P]; E on padding rows
    token = jnp.clip(plan.token_ids, 0, num_tokens - 1)  # [P]
    rows = jnp.where(valid[:, None], dh[:capacity], jnp.zeros((), dh.dtype))  # [P, 2n]
    onehot = (expert[:, None] == jnp.arange(num_experts)[None, :]).astype(dh.dtype)  # [P, E]
    db1 = jnp.einsum("pe,pn->en", onehot, rows, preferred_element_type=f32,
                     precision=highest)
    grad_out = grad_out.astype(dh.dtype).astype(f32)  # [T, d]
    weights = jnp.zeros((num_experts, num_tokens), f32).at[expert, token].set(
        jnp.where(valid, plan.scores.astype(f32), 0.0), mode="drop")  # [E, T]
    db2 = jnp.dot(weights, grad_out, precision=highest)  # [E, d]
    per_token = jnp.dot(grad_out, b_down.astype(f32).T, precision=highest)  # [T, E]
    ds_b = jnp.where(valid, per_token[token, jnp.minimum(expert, num_experts - 1)], 0.0)
    return ds_b, db1, db2


def dswiglu(h: jax.Array, grad_a: jax.Array) -> jax.Array:
    """Gradient of `silu(g) * u` w.r.t. `h = [g, u]`, given `grad_a = dL/dA`. fp32 [..., 2n]."""
    return SwiGLU().grad(h, grad_a)


def moe_ffn_backward(
    x: jax.Array,
    h: jax.Array,
    plan: DispatchPlan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    grad_out: jax.Array,
    *,
    activation: SwiGLU = SwiGLU(),
    b_down: jax.Array | None = None,
    block_m: int = 128,
    tiles_per_step: int = 8,
) -> tuple[jax.Array, ...]:
    """Gradients of `moe_ffn` from its minimal residuals.

    Args:
      x: [T, d] forward input.
      h: [P, 2n] saved up-proj output (x.dtype, `b_gate_up` already added); padding rows
        are never read.
      plan: the forward's dispatch plan.
      w_gate_up: [E, d, 2n]; w_down: [E, n, d].
      grad_out: [T, d] cotangent of the output.
      activation: the forward's `SwiGLU` spec.
      b_down: [E, d] down-projection bias for a layer with expert biases (pass zeros if it
        has only `b_gate_up`), or None for a layer without biases.

    Returns:
      (dx [T, d] x.dtype, d_scores f32[P] (0 on padding), dw_gate_up [E, d, 2n],
      dw_down [E, n, d]), the weight gradients in the weights' dtype; with `b_down` given,
      two more: db_gate_up [E, 2n] and db_down [E, d] in b_down's dtype.
    """
    num_tokens, d = x.shape
    dtype = x.dtype
    grad_out = grad_out.astype(dtype)
    with_biases = b_down is not None

    def step(carry, rows, valid, tok, s, e):  # [c, bm] x4, [c]
        dx, dw1, dw2, d_scores, db1, db2 = carry
        # Slots past a tile's rows read row 0 / token 0: select them to 0 (a multiply by
        # their score of 0 is not enough, NaN * 0 is NaN), so a NaN/Inf in token 0, in the
        # tile's expert weights or in a row the forward never wrote stays where it is.
        slot_is_row = valid[..., None]  # [c, bm, 1]
        h_t = jnp.where(slot_is_row, h[rows], 0)  # [c, bm, 2n]
        do_t = jnp.where(slot_is_row, grad_out[tok], 0)  # [c, bm, d] gather of dO
        x_t = jnp.where(slot_is_row, x[tok], 0)  # [c, bm, d] gather of X
        da = jnp.einsum("cmd,cnd->cmn", do_t, w_down[e], preferred_element_type=jnp.float32)
        da = jnp.where(slot_is_row, da, 0.0)  # 0 @ W2[e] is NaN where W2[e] holds NaN
        a = activation(h_t)  # f32[c, bm, n]
        ds = jnp.sum(da * a, axis=-1)  # [c, bm]
        if with_biases:
            # <dO[tok], b2[e]>: the bias term of Y = A W2 + b2 in dS = <dO[tok], Y>.
            ds = ds + jnp.einsum(
                "cmd,cd->cm", do_t.astype(jnp.float32), b_down[e].astype(jnp.float32)
            )
        dh = activation.grad(h_t, s[..., None] * da).astype(dtype)  # [c, bm, 2n]
        a_scaled = (s[..., None] * a).astype(dtype)  # [c, bm, n]
        dw2_t = jnp.einsum("cmn,cmd->cnd", a_scaled, do_t, preferred_element_type=jnp.float32)
        dw1_t = jnp.einsum("cmd,cmf->cdf", x_t, dh, preferred_element_type=jnp.float32)
        dx_rows = jnp.einsum("cmf,cdf->cmd", dh, w_gate_up[e], preferred_element_type=jnp.float32)
        dx_rows = jnp.where(slot_is_row, round_to(dx_rows, dtype), 0.0)  # the kernel's bf16 rows
        dx = dx.at[tok.reshape(-1)].add(dx_rows.reshape(-1, d))
        dw1 = dw1.at[e].add(dw1_t)
        dw2 = dw2.at[e].add(dw2_t)
        d_scores = d_scores.at[jnp.where(valid, rows, plan.capacity).reshape(-1)].set(
            ds.reshape(-1), mode="drop"
        )
        if with_biases:
            db1 = db1.at[e].add(jnp.sum(dh.astype(jnp.float32), axis=1))
            db2 = db2.at[e].add(jnp.einsum("cm,cmd->cd", s, do_t.astype(jnp.float32)))
        return dx, dw1, dw2, d_scores, db1, db2

    num_experts, _, two_n = w_gate_up.shape
    bias_shapes = ((num_experts, two_n), (num_experts, d)) if with_biases else ((0,), (0,))
    init = (
        jnp.zeros((num_tokens, d), jnp.float32),
        jnp.zeros(w_gate_up.shape, jnp.float32),
        jnp.zeros(w_down.shape, jnp.float32),
        jnp.zeros((plan.capacity,), jnp.float32),
        *(jnp.zeros(shape, jnp.float32) for shape in bias_shapes),
    )
    dx, dw1, dw2, d_scores, db1, db2 = scan_row_tiles(
        plan, step, init, block_m=block_m, tiles_per_step=tiles_per_step
    )
    grads = (dx.astype(dtype), d_scores, dw1.astype(w_gate_up.dtype), dw2.astype(w_down.dtype))
    if with_biases:
        grads += (db1.astype(b_down.dtype), db2.astype(b_down.dtype))
    return grads
