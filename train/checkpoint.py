"""Orbax checkpoints of a training run: model, optimizer state, step, data position.

Layout under `<out>/checkpoints/<step>/`:
    state/  the array pytree {"params", "rest", "opt_state"} (orbax StandardSave)
    meta/   JSON {"step", "data": loader state, "config": the run's config}

`rest` is the model's non-parameter state (for example RNG streams used by stochastic
rounding). Typed PRNG keys are stored as their raw key data and re-wrapped on restore.

Resume never gives up on the run because its newest checkpoint is damaged (a truncated or
zeroed array file, missing metadata): `restore_newest_valid` falls back to the newest
checkpoint that restores cleanly and reports the ones it skipped, with the reason;
`set_aside` then moves them out of the checkpoint directory (never deletes them).
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Callable

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


class CheckpointError(RuntimeError):
    """No checkpoint of a run restores; the message lists each one and why."""


def describe_error(error: BaseException, limit: int = 300) -> str:
    """One line for a failed restore: the exception type and the start of its message."""
    text = " ".join(str(error).split()) or "(no message)"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


def restore_newest_valid(
    mgr: ocp.CheckpointManager, template: dict, check_meta: Callable[[dict], None] | None = None
) -> tuple[int, dict, dict, list[tuple[int, str]]]:
    """Restores the newest checkpoint that restores cleanly.

    Args:
      mgr: the run's checkpoint manager.
      template: the state's structure, shapes and dtypes (as for `restore`).
      check_meta: called with each readable checkpoint's meta before its arrays are read;
        whatever it raises (for example a config mismatch) propagates: that is the user's
        error, not a damaged checkpoint, so it is never skipped.

    Returns:
      (step, state, meta, skipped): skipped lists (step, reason) for each newer checkpoint
      that failed to restore, newest first.

    Raises:
      FileNotFoundError: no checkpoint at all.
      CheckpointError: none restores (the message gives every reason).
    """
    steps = sorted(mgr.all_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {mgr.directory}")
    skipped: list[tuple[int, str]] = []
    for step in steps:
        try:
            _, meta = read_meta(mgr, step)
            if not isinstance(meta, dict) or meta.get("step") != step:
                raise ValueError(f"its meta does not describe step {step}")
        except Exception as error:  # any failure to read it means: damaged, try an older one
            skipped.append((step, f"metadata: {describe_error(error)}"))
            continue
        if check_meta is not None:
            check_meta(meta)
        try:
            _, state, meta = restore(mgr, template, step)
        except Exception as error:
            skipped.append((step, f"arrays: {describe_error(error)}"))
            continue
        return step, state, meta, skipped
    reasons = "; ".join(f"step {step}: {reason}" for step, reason in skipped)
    raise CheckpointError(f"no checkpoint in {mgr.directory} restores ({reasons}).")


def set_aside(mgr: ocp.CheckpointManager, steps: list[int], destination: str | pathlib.Path) -> list[pathlib.Path]:
    """Moves the given steps' checkpoint directories to `destination/<step>` (not deleted), so
    the resumed run can save those steps again; reloads the manager. Returns the new paths."""
    destination = pathlib.Path(destination)
    moved = []
    for step in steps:
        source = pathlib.Path(mgr.directory) / str(step)
        if not source.exists():
            continue
        destination.mkdir(parents=True, exist_ok=True)
        target = destination / str(step)
        suffix = 1
        while target.exists():  # an earlier resume set this step aside already
            target = destination / f"{step}.{suffix}"
            suffix += 1
        shutil.move(str(source), str(target))
        moved.append(target)
    mgr.reload()
    return moved
