"""Router score formulas with one evaluation order, so every program computes the same bits.

The routing implementations (`topk_plan` / `token_rounding_plan` with impl "dense", "sort",
"kernel") must give bitwise the same scores and gradients to the logits, but they are
different XLA programs: the probabilities feed a `lax.top_k` and scatters in one, a Pallas
call in another. XLA compiles a row reduction by the fusion it lands in (a Triton softmax
fusion or the native reduction emitter, with its own order of the row sum), so one
`jax.nn.softmax` gave scores one ulp apart on the H100 at E=60 (0.0805698 vs 0.08056981),
and fused backward reductions did too (XLA:CPU, T=45, E=12). Optimization barriers around
the formulas did not make the forward agree, and they cost a pass where the sigmoid
feeds the selection bias.

So no formula here leaves an order to XLA. The GPU's softmax over the experts is one
Pallas kernel (`kernels.softmax_rows`), the same compiled program wherever it is called.
Everything else (the softmax off the GPU, log-softmax, the tangent maps) has no reduction:
every row sum and row maximum is an explicit pairwise tree of elementwise ops over slices of
the last axis (`tree_sum`, `tree_max`), and XLA never reassociates a float add, whatever
fusion it lands in. What is left is elementwise (`exp`, `log`, `logistic`, subtract,
multiply, a row's reciprocal), the same per element in any program.

Derivatives follow the same rule for the backward pass: each formula is a `jax.custom_jvp`
whose tangent map broadcasts a row value by doubling (`broadcast_row`), so its transpose
(the backward pass) sums by a pairwise tree, not a `reduce_sum`; the tangent map's own row
sum is a `jnp.sum`, whose transpose is an exact broadcast (forward-mode tangents therefore
sum in XLA's order: exact, but not bitwise across programs). The tangent map sits
between optimization barriers, which only the derivatives see: a multiply and an add form a
fused multiply-add inside one fusion and not across two, and the barriers keep each
implementation's cotangent producer and gradient consumer out of the tangent map's fusion.
One thing no order fixes: a consumer that adds to a probability inside the same fusion may
contract the softmax's last multiply into a fused multiply-add. The routers only gather,
select and scatter the probabilities, and add the selection bias to a sigmoid, whose last
op is a division, which never contracts.

Shapes: every function maps `f32[..., N]` to `f32[..., N]` over the last axis, except
`tree_sum` / `tree_max` (`[..., N] -> [..., 1]`) and `broadcast_row` (`[..., 1] -> [..., N]`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _pairwise(x: jax.Array, op) -> jax.Array:
    """`[..., N] -> [..., 1]`: pairs `(i, i + N//2)` for `i < N//2`, the odd last column
    carried to the next level, until one column is left."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        paired = op(x[..., :half], x[..., half : 2 * half])
        x = paired if n % 2 == 0 else jnp.concatenate([paired, x[..., 2 * half :]], axis=-1)
    return x


def tree_sum(x: jax.Array) -> jax.Array:
    """Row sums `[..., N] -> [..., 1]` by a fixed pairwise tree of adds (see `_pairwise`)."""
    return _pairwise(x, jnp.add)


def tree_max(x: jax.Array) -> jax.Array:
    """Row maxima `[..., N] -> [..., 1]` by a fixed pairwise tree (NaN propagates)."""
    return _pairwise(x, jnp.maximum)


def broadcast_row(v: jax.Array, width: int) -> jax.Array:
    """`[..., 1] -> [..., width]` copies of `v` by doubling concatenations.

    Equal to a broadcast, but its transpose (a cotangent summed back to `[..., 1]`) is a
    pairwise tree of adds where a broadcast's is a `reduce_sum`.
    """
    out = v
    while out.shape[-1] < width:
        out = jnp.concatenate([out, out], axis=-1)
    return out[..., :width]


def _on_gpu() -> bool:
    """Whether the softmax runs as the GPU's Pallas kernel (the default backend is a GPU)."""
    return jax.default_backend() == "gpu"


def _row_sum_transposing_to_broadcast(t: jax.Array) -> jax.Array:
    """`[..., N] -> [..., 1]` row sums inside a tangent map, by `jnp.sum`.

    Its transpose (what the backward runs) is an exact broadcast, where `tree_sum`'s is a
    ladder of full-width pads and adds (7 levels at N = 128) that XLA compiled to 57-176 us
    of add fusions per training step on the H100 (session 6). The backward's only row sum is
    then the transpose of `broadcast_row`: a pairwise tree over halves, in a fixed order.
    The price: forward-mode tangents (`jax.jvp`) sum in XLA's order, so they are exact
    derivatives but not bitwise equal across programs; gradients still are.
    """
    # A reshape, not keepdims: the transpose of keepdims' broadcast is a (size-1) reduce_sum.
    return jnp.sum(t, axis=-1).reshape(t.shape[:-1] + (1,))


def _isolated(t: jax.Array) -> jax.Array:
    """A tangent between optimization barriers (see the module docstring)."""
    return jax.lax.optimization_barrier(t)


@jax.custom_jvp
def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis, `exp(x - max) * (1 / sum)`.

    On a GPU one Pallas kernel (`kernels.softmax_rows`): a compiled kernel is the same
    program wherever it is called, and one pass over the logits like XLA's softmax fusion
    (the trees below would be several in XLA). Elsewhere XLA ops
    with the tree maximum and sum. Either way a multiply by the row's reciprocal, as
    written: XLA rewrites `A / broadcast(B)` into `A * broadcast(1 / B)` itself, so a
    division would not be the operation it reads.
    """
    if _on_gpu():
        from pallas_moe.routing import kernels  # Pallas is imported only when used.

        return kernels.softmax_rows(x.reshape(-1, x.shape[-1])).reshape(x.shape)
    shifted = x - tree_max(x)
    unnormalized = jnp.exp(shifted)
    return unnormalized * (1.0 / tree_sum(unnormalized))


@softmax.defjvp
def _softmax_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    p = softmax(x)
    t = _isolated(t)
    return p, _isolated(p * (t - broadcast_row(_row_sum_transposing_to_broadcast(p * t),
                                                 x.shape[-1])))


@jax.custom_jvp
def log_softmax(x: jax.Array) -> jax.Array:
    """Log-softmax over the last axis, `(x - max) - log(sum(exp(x - max)))`, tree ops."""
    shifted = x - tree_max(x)
    return shifted - jnp.log(tree_sum(jnp.exp(shifted)))


@log_softmax.defjvp
def _log_softmax_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    p = softmax(x)
    t = _isolated(t)
    return log_softmax(x), _isolated(
        t - broadcast_row(_row_sum_transposing_to_broadcast(p * t), x.shape[-1]))


@jax.custom_jvp
def sigmoid(x: jax.Array) -> jax.Array:
    """Elementwise `1 / (1 + exp(-x))` (`jax.nn.sigmoid`)."""
    return jax.nn.sigmoid(x)


@sigmoid.defjvp
def _sigmoid_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = sigmoid(x)
    return y, _isolated(_isolated(t) * (y * (1.0 - y)))


@jax.custom_jvp
def log_sigmoid(x: jax.Array) -> jax.Array:
    """Elementwise `log(sigmoid(x))` (`jax.nn.log_sigmoid`)."""
    return jax.nn.log_sigmoid(x)


@log_sigmoid.defjvp
def _log_sigmoid_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return log_sigmoid(x), _isolated(_isolated(t) * sigmoid(-x))
