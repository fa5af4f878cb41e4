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
