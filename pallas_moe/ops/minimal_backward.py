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
    *,
    block_m: int = 128,
    tiles_per_step: int = 8,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The expert-bias terms of the backward, from a computed dH (the kernel backward's).

        dS_b[r] = <dO[tok[r]], b2[e]>                     f32 [P]   (add to dS)
        db1[e]  = sum over rows r of e of dH[r]            f32 [E, 2n]
        db2[e]  = sum over rows r of e of s[r] * dO[tok[r]]   f32 [E, d]

    Deterministic without atomics: the plan's row tiles (one expert each) are walked in
    ascending expert order (`scan_row_tiles`), each tile's rows are summed in fp32, and the
    tile sums are added to their expert's total one tile after another; each row's dS term
    is written once. The same sums as `moe_ffn_backward`'s (up to the order inside a tile).

    Args:
      dh: [P_pad, 2n] (P_pad >= P) dH in grouped row order, rounded to the compute dtype.
      plan: the plan with the scores the forward multiplied by.
      grad_out: [T, d] cotangent of the output.
      b_down: [E, d] down-projection bias (zeros for a layer with only `b_gate_up`).
      block_m, tiles_per_step: the row-tile walk (as `moe_ffn_xla`).

    Returns:
      (dS_b f32 [P] (0 on padding rows), db1 f32 [E, 2n], db2 f32 [E, d]).
    """
    num_experts, d = b_down.shape
    two_n = dh.shape[1]
    grad_out = grad_out.astype(dh.dtype)

    def step(carry, rows, valid, tok, s, e):  # [c, bm] x4, [c]
        ds_b, db1, db2 = carry
        slot_is_row = valid[..., None]  # [c, bm, 1]; selects keep NaNs where they are
        dh_t = jnp.where(slot_is_row, dh[rows].astype(jnp.float32), 0.0)  # [c, bm, 2n]
        do_t = jnp.where(slot_is_row, grad_out[tok].astype(jnp.float32), 0.0)  # [c, bm, d]
        ds_t = jnp.einsum("cmd,cd->cm", do_t, b_down[e].astype(jnp.float32))
        ds_b = ds_b.at[jnp.where(valid, rows, plan.capacity).reshape(-1)].set(
            ds_t.reshape(-1), mode="drop"
        )
        db1_t = jnp.sum(dh_t, axis=1)  # [c, 2n]
        db2_t = jnp.einsum("cm,cmd->cd", s, do_t)  # [c, d]
        for i in range(rows.shape[0]):  # one tile after another: no colliding scatter
            db1 = db1.at[e[i]].add(db1_t[i])
            db2 = db2.at[e[i]].add(db2_t[i])
        return ds_b, db1, db2

    init = (
        jnp.zeros((plan.capacity,), jnp.float32),
        jnp.zeros((num_experts, two_n), jnp.float32),
        jnp.zeros((num_experts, d), jnp.float32),
    )
    return scan_row_tiles(plan, step, init, block_m=block_m, tiles_per_step=tiles_per_step)


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
