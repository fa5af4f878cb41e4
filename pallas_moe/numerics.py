"""Numerics switches of one MoE layer: aggregation order, SwiGLU fusion, router dtype.

Training and inference engines compute "the same" MoE layer with different rounding
orders, and RL on MoE models (GRPO, RLHF) needs the fast path's log-probabilities to
match a reference engine's. `Numerics` exposes each choice as its own switch instead of
one "disable optimizations" flag:

    numerics = pm.Numerics(aggregation="bf16_per_expert")   # HF's reference order
    y = pm.moe_ffn(x, plan, w_gate_up, w_down, numerics=numerics)
    layer = pm.nn.MoE(..., numerics=numerics)

Aggregation modes, `O[t] = sum over the rows r of token t, in ascending expert order`:

| mode | contribution of row r | running sum | what it reproduces |
|---|---|---|---|
| "fp32" (default) | `s[r] * Y[r]` in fp32 (on the GPU fused with the add into one FMA) | fp32, one rounding at the end | a batched fp32 weighted sum |
| "bf16_per_expert" | `bf16(s[r] * Y[r])`, score multiplied in fp32 | bf16 after every add | HF's loop over experts with `index_add_` in bf16 |
| "bf16_scores" | `bf16(bf16(s[r]) * Y[r])` | bf16 after every add | DeepEP's combine (score cast to bf16 first) |

`Y[r]` is the down-projection output, already rounded to the activation dtype. The bf16
modes start from +0 and round after the multiply and after each addition, exactly as a
sequence of bf16 tensor ops does (an fp32 op on bf16 inputs rounded back to bf16 is
correctly rounded: fp32 has more than 2*8+2 significand bits). A token with no rows gets
+0 in every mode.

Backward (the same on every backend): the roundings pass their cotangent through
unchanged and in fp32 (straight-through), so with `g = dL/dO[t]` in the activation dtype:

| mode | `dL/dY[r]` | `dL/ds[r]` |
|---|---|---|
| "fp32", "bf16_per_expert" | `s[r] * g` | `<g, Y[r]>` |
| "bf16_scores" | `bf16(s[r]) * g` (the score the forward multiplied by) | `<g, Y[r]>` (straight through the score's rounding) |

The kernel path never forms `dL/dY`: its dH and `A' = s*A` use the same score, and its
`dS = <g @ W2^T, A>` is `<g, Y>` before `Y`'s bf16 rounding (see `ops/minimal_backward.py`).
The `xla` backend is differentiated by autodiff and uses the rounded `Y`. The backward's
`dX` sum over a token's rows is the plain fp32 sum in every mode: it is the transpose of
the token gather, not of the aggregation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

AGGREGATIONS = ("fp32", "bf16_per_expert", "bf16_scores")
ROUTER_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Per-fusion numerics switches (frozen and hashable: safe as a jit static argument).

    Attributes:
      aggregation: how each token's expert outputs are weighted and summed: "fp32"
        (default), "bf16_per_expert" or "bf16_scores" (module docstring). The bf16 modes
        need bf16 activations.
      fuse_swiglu: True (default) computes `A = silu(H_gate) * H_up` in the up-proj
        kernel's epilogue; False writes H and applies SwiGLU after, in jnp, from H (the
        unfused order of a reference engine). Both compute A in fp32 from the bf16 H and
        round it once, so they differ only where the kernel's `exp`/`sigmoid` differ from
        XLA's (on the GPU; in interpret mode on CPU they are bitwise equal). The `xla`
        backend always applies SwiGLU after, from H, and ignores the switch. The backward
        recomputes A from H in its dH epilogue either way.
      router_dtype: "float32" (default): router logits `x @ W_r` from fp32 inputs with
        fp32 accumulation. "bfloat16": a bf16 linear layer as engines and HF run it: x and
        W_r rounded to bf16, fp32 accumulation, logits rounded to bf16; softmax/top-K
        then run in fp32 on those logits. Its backward is that layer's too: the logits'
        gradient rounded to bf16, bf16 GEMMs (`pm.nn.functional.bf16_linear`). Used by
        `pm.nn.MoE` (the op `pm.moe_ffn` takes a finished plan and has no router).
    """

    aggregation: str = "fp32"
    fuse_swiglu: bool = True
    router_dtype: str = "float32"

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}."
            )
        if not isinstance(self.fuse_swiglu, bool):
            raise TypeError(f"fuse_swiglu must be a bool, got {self.fuse_swiglu!r}.")
        if self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(
                f"router_dtype must be one of {ROUTER_DTYPES}, got {self.router_dtype!r}."
            )

    @property
    def rounds_to_bf16(self) -> bool:
        """Whether the aggregation rounds contributions and partial sums to bf16."""
        return self.aggregation != "fp32"


def check_numerics(numerics) -> Numerics:
    """`numerics` itself, `Numerics()` for None; a TypeError naming the argument otherwise."""
    if numerics is None:
        return Numerics()
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics must be a pallas_moe.Numerics, got {type(numerics).__name__}.")
    return numerics


def check_activation_dtype(numerics: Numerics, dtype) -> None:
    """The bf16 aggregation modes reproduce a bf16 engine: they need bf16 activations."""
    if numerics.rounds_to_bf16 and jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(
            f"aggregation={numerics.aggregation!r} rounds to bfloat16 and needs bf16 "
            f"activations (x.dtype is {jnp.dtype(dtype)}); compute in bf16 or use "
            "aggregation='fp32'."
        )


@jax.custom_jvp
def round_bf16(x: jax.Array) -> jax.Array:
    """Rounds f32 values to bf16 precision (nearest even), staying f32.

    `lax.reduce_precision` is never simplified away (an f32->bf16->f32 convert pair may
    be, under XLA's excess-precision rule on GPU). Its derivative is the identity in fp32
    (straight-through), so gradients are not rounded.
    """
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


@round_bf16.defjvp
def _round_bf16_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return round_bf16(x), t.astype(jnp.float32)


def round_to(x: jax.Array, dtype) -> jax.Array:
    """`x` rounded to `dtype`'s precision, as f32: a reference's rounding point (a value the
    kernels store in `dtype` and read back). bf16 goes through `round_bf16`, which XLA on a
    GPU cannot drop (measured on the H100, session 19: it dropped the convert pair of the
    fp8 epilogue reference, 34% of A's elements one bf16 step off); other dtypes through
    the convert pair."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return round_bf16(x)
    return x.astype(dtype).astype(jnp.float32)


def multiplied_scores(scores: jax.Array, aggregation: str) -> jax.Array:
    """f32 router weights as the aggregation multiplies them: bf16-rounded for "bf16_scores".

    The backward multiplies by the same values (dH, A'), so it matches the forward.
    """
    scores = scores.astype(jnp.float32)
    return round_bf16(scores) if aggregation == "bf16_scores" else scores


def contribution(y: jax.Array, scores: jax.Array, aggregation: str) -> jax.Array:
    """f32 [..., d] weighted rows `s * Y` of one aggregation step.

    Args:
      y: [..., d] expert outputs (any float dtype; read as f32).
      scores: f32 [...] router weights as stored in the plan (not yet rounded).
      aggregation: one of `AGGREGATIONS`.
    """
    c = y.astype(jnp.float32) * multiplied_scores(scores, aggregation)[..., None]
    return c if aggregation == "fp32" else round_bf16(c)


def accumulate(acc: jax.Array, c: jax.Array, aggregation: str) -> jax.Array:
    """f32 running sum `acc + c`, rounded to bf16 after the add in the bf16 modes."""
    total = acc + c
    return total if aggregation == "fp32" else round_bf16(total)
