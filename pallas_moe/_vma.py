"""Varying-manual-axes (vma) helpers for code that runs inside `jax.shard_map(check_vma=True)`.

With `check_vma=True`, every value inside a shard_map carries the set of mesh axes it
varies over. Scan carries and `custom_vjp` cotangents must keep their input's set, so a
zero buffer made inside the body, or a weight replicated over the data axis, has to be
cast up (`jax.lax.pcast(..., to="varying")`) before it meets varying tokens; the cast's
transpose is the psum that the gradient of a replicated value needs. Outside shard_map,
or with `check_vma=False`, every set is empty and these are no-ops.
"""

from __future__ import annotations

import jax


def varying_axes(a) -> frozenset:
    """The mesh axes `a` (an array or an abstract value) varies over."""
    aval = a if isinstance(a, jax.ShapeDtypeStruct) else jax.typeof(a)
    mat = aval.manual_axis_type  # None on a ShapeDtypeStruct outside check_vma
    return frozenset() if mat is None else mat.varying


def vary(a: jax.Array, axes: frozenset) -> jax.Array:
    """`a` cast to vary over `axes` as well."""
    missing = frozenset(axes) - varying_axes(a)
    return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a


def vary_together(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Every array cast to the union of their varying axes."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays))
    return tuple(vary(a, axes) for a in arrays)


def pallas_call(kernel, *, out_shape, **kwargs):
    """`pl.pallas_call` that also runs inside `jax.shard_map(check_vma=True)`.

    There, a pallas_call's output types must say which mesh axes they vary over, and its
    inputs must agree. The returned function casts its inputs to the union of their
    varying axes (`vary_together`) and gives every `out_shape` entry that union; outside
    shard_map, or with `check_vma=False`, the union is empty and this is `pl.pallas_call`.
    """
    from jax.experimental import pallas as pl  # Pallas is imported only when used.

    def call(*args):
        args = vary_together(*args)
        axes = frozenset().union(*(varying_axes(a) for a in args))
        mat = jax.typeof(args[0]).manual_axis_type.update(varying=axes) if args else None

        def typed(s):
            return jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat)

        shapes = jax.tree.map(typed, out_shape, is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct))
        return pl.pallas_call(kernel, out_shape=shapes, **kwargs)(*args)

    return call
