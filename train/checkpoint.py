"""Orbax checkpoints of a training run: model, optimizer state, step, data position.

Layout under `<out>/checkpoints/<step>/`:
    state/  the array pytree {"params", "rest", "opt_state"} (orbax StandardSave)
    meta/   JSON {"step", "data": loader state, "config": the run's config}

`rest` is the model's non-parameter state (for example RNG streams used by stochastic
rounding). Typed PRNG keys are stored as their raw key data and re-wrapped on restore.
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def keys_to_data(tree):
    """Replaces typed PRNG key leaves by their uint32 key data (orbax stores plain arrays)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def data_to_keys(tree, template):
    """Inverse of `keys_to_data`, using `template`'s leaves to know which were keys."""
    return jax.tree.map(
        lambda x, t: jax.random.wrap_key_data(x, impl=jax.random.key_impl(t)) if _is_key(t) else x,
        tree, template,
    )


def manager(directory: str | pathlib.Path, keep: int) -> ocp.CheckpointManager:
    directory = pathlib.Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False
    )
    return ocp.CheckpointManager(directory, options=options)


def save(mgr: ocp.CheckpointManager, step: int, state: dict, meta: dict) -> None:
    """Saves the array pytree `state` and the JSON-able `meta` at `step` (synchronously)."""
    mgr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(keys_to_data(state)), meta=ocp.args.JsonSave(meta)
        ),
        force=True,
    )
    mgr.wait_until_finished()


def read_meta(mgr: ocp.CheckpointManager, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of the latest (or given) checkpoint, without reading any array."""
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {mgr.directory}")
    return step, mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def restore(mgr: ocp.CheckpointManager, template: dict, step: int | None = None) -> tuple[int, dict, dict]:
    """Restores (step, state, meta); `template` gives the state's structure, shapes and dtypes."""
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {mgr.directory}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, keys_to_data(template))
    restored = mgr.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
    )
    return step, data_to_keys(restored["state"], template), restored["meta"]
