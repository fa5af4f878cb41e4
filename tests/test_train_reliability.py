"""Reliability of the training job: no lost runs, no silent NaN, config errors up front.

One test per training row of the reliability table (issue 10), plus kill-and-resume tests
(a kill during a checkpoint write and a kill mid metrics line, in a subprocess that
SIGKILLs itself: `tests/train_kill.py`; a corrupted newest checkpoint). A resumed run must
match an uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.test_train import SMALL, small_config
from train import data
from train.configs import ConfigError, get_config, with_overrides

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Checkpoints at 2, 4 and 6 (all kept); no validation between (eval only at the end).
RUN = dict(steps=6, checkpoint_every=2, keep_checkpoints=3, eval_every=100)


@pytest.fixture(scope="module")
def split():
    return data.load_split(5.0)


def _train(cfg, split, **kwargs):
    from train.trainer import train

    return train(cfg, progress=False, plot=False, data_split=split, **kwargs)


def _losses(out_dir) -> dict[int, float]:
    from train.trainer import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(pathlib.Path(out_dir) / "metrics.jsonl") if r["split"] == "train"}


def _snapshot(out_dir: pathlib.Path) -> dict[str, tuple[bytes, int]]:
    """Every file under out_dir: (content, mtime_ns)."""
    return {
        str(p.relative_to(out_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(out_dir.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, split):
    """An uninterrupted run; its losses are what every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    cfg = small_config(out, "run", **RUN)
    result = _train(cfg, split)
    losses = _losses(result.out_dir)
    assert sorted(losses) == list(range(1, 7)) and all(math.isfinite(v) for v in losses.values())
    return cfg, result, losses


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory, split):
    """The same run stopped after step 4: checkpoints 2 and 4, metrics up to step 4."""
    out = tmp_path_factory.mktemp("stopped")
    cfg = small_config(out, "run", **RUN)
    result = _train(cfg, split, stop_at=4)
    assert result.final_step == 4
    return cfg


def _copy_run(cfg, tmp_path):
    """A copy of cfg's run directory under tmp_path, and cfg pointing at it."""
    out = tmp_path / "copy"
    shutil.copytree(cfg.out_dir, out)
    return with_overrides(cfg, out=str(out)), out


# ---------------------------------------------------------------- runs are never destroyed silently


def test_new_run_into_non_empty_dir_is_refused(tmp_path, split, reference, capsys):
    from train.main import main
    from train.trainer import RunDirError

    cfg, out = _copy_run(reference[0], tmp_path)
    before = _snapshot(out)
    with pytest.raises(RunDirError, match="--resume.*--overwrite"):
        _train(cfg, split)
    assert _snapshot(out) == before  # nothing deleted, nothing rewritten

    args = ["--config", "tiny", "--out", str(out), "--no-progress"]
    for key, value in {**SMALL, **RUN}.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--resume" in err and "--overwrite" in err
    assert _snapshot(out) == before

    # A directory holding anything at all (here: a note) is not a new run's either.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(RunDirError, match="notes.txt"):
        _train(with_overrides(cfg, out=str(other)), split)

    # --overwrite starts again: the old run's outputs go, other files stay.
    (out / "notes.txt").write_text("keep me")
    # stop_at=2 on the reference's schedule: the train step the reference compiled.
    result = _train(cfg, split, overwrite=True, stop_at=2)
    assert result.final_step == 2 and sorted(_losses(out)) == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2"]
    assert (out / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="exclude each other"):
        _train(cfg, split, resume=True, overwrite=True)


@pytest.mark.parametrize("damage", ["truncated_array_file", "zeroed_array_file", "missing_state_metadata",
                                    "missing_meta"])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, split, reference, stopped_at_4, damage, capsys):
    cfg, out = _copy_run(stopped_at_4, tmp_path)
    newest = out / "checkpoints" / "4"
    largest = max((p for p in (newest / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    if damage == "truncated_array_file":
        largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 3])
    elif damage == "zeroed_array_file":
        largest.write_bytes(bytes(largest.stat().st_size))
    elif damage == "missing_state_metadata":
        (newest / "state" / "_METADATA").unlink()
    else:
        shutil.rmtree(newest / "meta")

    resumed = _train(with_overrides(cfg, steps=6), split, resume=True)
    err = capsys.readouterr().err
    assert f"checkpoint {newest} does not restore, skipped" in err, err
    assert "resuming from step 2" in err
    assert resumed.final_step == 6
    assert _losses(out) == reference[2]  # steps 3..6 recomputed bit for bit
    assert (out / "checkpoints_skipped" / "4").is_dir()  # set aside, not deleted
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4", "6"]
    info = [r for r in _read(out) if r["split"] == "info"][-1]
    assert [s["step"] for s in info["skipped_checkpoints"]] == [4]


def _read(out):
    from train.trainer import read_metrics

    return read_metrics(out / "metrics.jsonl")


def test_resume_with_no_checkpoint_that_restores_is_a_clear_error(tmp_path, split, stopped_at_4):
    from train.checkpoint import CheckpointError

    cfg, out = _copy_run(stopped_at_4, tmp_path)
    for step in ("2", "4"):
        shutil.rmtree(out / "checkpoints" / step / "meta")
    before = _snapshot(out)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* restores \(step 4: metadata: .*step 2: metadata: "):
        _train(cfg, split, resume=True)
    assert _snapshot(out) == before


def _run_and_kill(out, kill: str, step: int):
    args = [sys.executable, "-m", "tests.train_kill", "--out", str(out), "--kill", kill, "--step", str(step)]
    for key, value in {**SMALL, **RUN}.items():
        args += ["--set", f"{key}={value}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])  # SIGKILL


def test_kill_during_checkpoint_write_then_resume(tmp_path, split, reference):
    out = tmp_path / "killed"
    _run_and_kill(out, "checkpoint", 4)
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    cfg = small_config(tmp_path, "killed", **RUN)
    result = _train(cfg, split, resume=True)
    assert result.final_step == 6
    assert _losses(out) == reference[2]


def test_torn_metrics_line_is_dropped_with_a_warning(tmp_path, split, reference, capsys):
    out = tmp_path / "torn"
    _run_and_kill(out, "metrics", 3)
    last = (out / "metrics.jsonl").read_text().splitlines()[-1]
    with pytest.raises(json.JSONDecodeError):
        json.loads(last)  # the kill really tore the line
    cfg = small_config(tmp_path, "torn", **RUN)
    result = _train(cfg, split, resume=True)
    err = capsys.readouterr().err
    assert "dropped line" in err and "not a complete JSON record" in err, err
    assert result.final_step == 6
    assert _losses(out) == reference[2]
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # every line whole again


def test_resuming_a_finished_run_changes_nothing(tmp_path, split, reference, capsys):
    from train.main import main

    cfg, out = _copy_run(reference[0], tmp_path)
    before = _snapshot(out)
    result = _train(cfg, split, resume=True)
    assert result.nothing_to_do and "already finished" in result.nothing_to_do
    assert result.final_step == 6 and result.final_val == reference[1].final_val
    assert _snapshot(out) == before

    # --steps below the checkpoint: the same, nothing to do and nothing changed.
    result = _train(with_overrides(cfg, steps=4, warmup_steps=1), split, resume=True)
    assert result.nothing_to_do and "at step 6" in result.nothing_to_do
    assert _snapshot(out) == before

    args = ["--config", "tiny", "--out", str(out), "--no-progress", "--resume"]
    for key, value in {**SMALL, **RUN}.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0
    stdout = capsys.readouterr().out
    assert "nothing to do" in stdout and "nan" not in stdout
    assert _snapshot(out) == before


# ---------------------------------------------------------------- a diverging run names its step


def test_diverging_run_names_the_first_bad_step_and_saves_no_nan_checkpoint(tmp_path, split):
    """lr=1e30 blows the parameters up after the first update with a nonzero learning rate.

    Logged every step, the first non-finite loss is found directly; logged every 7 steps (so
    the first record comes after it) and checkpointed every step, the error must name the
    same step, and no checkpoint of it or later (NaN parameters) may exist.
    """
    common = dict(steps=8, lr=1e30, warmup_steps=1, grad_clip=0.0, eval_every=100)
    with pytest.raises(FloatingPointError, match=r"became (nan|inf|-inf) at step (\d+)") as every_step:
        _train(small_config(tmp_path, "every", log_every=1, checkpoint_every=100, **common), split)
    bad_step = int(every_step.value.args[0].split(" at step ")[1].split()[0].rstrip(";"))
    records = _read(tmp_path / "every")
    logged = [r["step"] for r in records if r["split"] == "train"]
    assert logged == list(range(1, bad_step)) and all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    assert 1 < bad_step < 7, bad_step

    cfg = small_config(tmp_path, "sparse", log_every=7, checkpoint_every=1, **common)
    with pytest.raises(FloatingPointError, match=rf"at step {bad_step}\b.*no checkpoint of this or a later step"):
        _train(cfg, split)
    saved = sorted(int(p.name) for p in (tmp_path / "sparse" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) < bad_step, saved


# ---------------------------------------------------------------- config validation up front


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"lr": math.inf}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"weight_decay": math.nan}, "weight_decay"),
        ({"weight_decay": math.inf}, "weight_decay"),
        ({"rope_base": 0.0}, "rope_base"),
        ({"rope_base": -10_000.0}, "rope_base"),
        ({"rope_base": math.nan}, "rope_base"),
        ({"grad_clip": math.nan}, "grad_clip"),
        ({"grad_clip": math.inf}, "grad_clip"),
        ({"load_balance_weight": math.inf}, "load_balance_weight"),
        ({"final_lr_fraction": math.nan}, "final_lr_fraction"),
        ({"b2": math.nan}, "b2"),
        ({"backend": "mosaic"}, "dtype"),
        ({"backend": "interpret"}, "dtype"),
        ({"backend": "mosaic", "dtype": "bfloat16", "d_model": 96, "num_heads": 4}, "d_model"),
        ({"backend": "interpret", "dtype": "bfloat16", "d_model": 128, "d_expert": 32}, "d_expert"),
    ],
)
def test_bad_config_value_names_field_up_front(overrides, field):
    with pytest.raises(ConfigError, match=rf"^{field}\b"):
        with_overrides(get_config("tiny"), **overrides)


def test_kernel_backend_with_bf16_and_aligned_widths_is_valid():
    cfg = with_overrides(get_config("tiny"), backend="interpret", dtype="bfloat16", d_model=128, d_expert=64)
    assert cfg.backend == "interpret"


def test_cli_kernel_backend_with_float32_exits_2(capsys):
    from train.main import main

    assert main(["--config", "tiny", "--backend", "mosaic"]) == 2
    assert "dtype must be 'bfloat16' with backend='mosaic'" in capsys.readouterr().err
    assert main(["--config", "tiny", "--set", "grad_clip=nan"]) == 2
    assert "grad_clip must be finite" in capsys.readouterr().err


def test_mosaic_backend_without_hopper_fails_before_the_run(tmp_path, split, capsys):
    import jax

    device = jax.devices()[0]
    if device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0":
        pytest.skip("checks the error on machines without a Hopper GPU")
    from train.main import main

    cfg = with_overrides(get_config("tiny"), backend="mosaic", dtype="bfloat16", out=str(tmp_path / "m"))
    with pytest.raises(ConfigError, match="backend='mosaic' needs a Hopper GPU"):
        _train(cfg, split)
    assert not (tmp_path / "m").exists()  # nothing created
    assert main(["--config", "tiny", "--backend", "mosaic", "--set", "dtype=bfloat16",
                 "--out", str(tmp_path / "m")]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err
