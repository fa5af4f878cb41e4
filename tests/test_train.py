"""Training experiments (`train/`): config validation, data split, smoke run, exact resume, CLI."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from train import configs, data
from train.configs import ConfigError, get_config, with_overrides

# A reduced `tiny`: same code paths, seconds instead of minutes.
SMALL = dict(
    d_model=32, num_heads=2, num_layers=1, d_expert=32, num_experts=4, top_k=2,
    seq_len=32, batch_size=4, tile=16, eval_batches=1, log_every=1,
)


def small_config(tmp_path: pathlib.Path, name: str, **overrides) -> configs.Config:
    return with_overrides(get_config("tiny"), **{**SMALL, "out": str(tmp_path / name), **overrides})


@pytest.fixture(scope="module")
def split():
    return data.load_split(5.0)


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"routing": "expert_choice"}, "routing"),
        ({"rounding": "sideways"}, "rounding"),
        ({"num_heads": 3}, "num_heads"),
        ({"top_k": 9}, "top_k"),
        ({"d_model": 0}, "d_model"),
        ({"tile": -128}, "tile"),
        ({"seq_len": 12.5}, "seq_len"),
        ({"lr": 0.0}, "lr"),
        ({"warmup_steps": 700}, "warmup_steps"),
        ({"dtype": "float16"}, "dtype"),
        ({"vocab_size": 512}, "vocab_size"),
        ({"val_percent": 100}, "val_percent"),
        ({"positions": "alibi"}, "positions"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"batch_size": True}, "batch_size"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_config_names_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        with_overrides(get_config("tiny"), **overrides)


def test_named_configs_are_valid():
    for name, cfg in configs.CONFIGS.items():
        assert configs.validate(cfg) is cfg and cfg.name == name
    with pytest.raises(ConfigError, match="config must be one of"):
        get_config("huge")


def test_steps_override_scales_warmup():
    cfg = with_overrides(get_config("tiny"), steps=60)
    assert cfg.warmup_steps == get_config("tiny").warmup_steps * 60 // get_config("tiny").steps


def test_cli_bad_config_exits_2(capsys):
    from train.main import main

    assert main(["--config", "tiny", "--routing", "nope"]) == 2
    assert "routing" in capsys.readouterr().err
    assert main(["--config", "tiny", "--set", "num_experts=many"]) == 2
    assert "num_experts" in capsys.readouterr().err
    assert main(["--config", "tiny", "--set", "top_k=16"]) == 2
    assert "top_k" in capsys.readouterr().err
    assert main(["--config", "missing"]) == 2


# ---------------------------------------------------------------- data


def test_split_is_by_file_and_deterministic():
    files = data.stdlib_files()
    assert len(files) > 100
    val = {f for f in files if data.is_validation(f, 5.0)}
    assert 0 < len(val) < len(files) // 5
    assert val == {f for f in files if data.is_validation(f, 5.0)}  # deterministic
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def test_batches_are_real_bytes_and_resumable(split):
    train_bytes, val_bytes, info = split
    assert info["train_bytes"] > 10 * info["val_bytes"] > 0
    loader = data.Batches(train_bytes, 4, 32, seed=1)
    first = loader.next()
    assert first.shape == (4, 33) and first.dtype == np.uint8
    text = bytes(first[0])
    assert sum(32 <= b < 127 or b in (9, 10) for b in text) > 0.9 * len(text)  # source text, not noise
    state = loader.state()
    expected = [loader.next() for _ in range(3)]
    other = data.Batches(train_bytes, 4, 32, seed=1)
    other.restore(state)
    for want in expected:
        np.testing.assert_array_equal(other.next(), want)
    val = data.validation_batches(val_bytes, 4, 32, 2)
    assert len(val) == 2 and val[0].shape == (4, 33)


# ---------------------------------------------------------------- training


def _train_losses(metrics_path) -> dict[int, float]:
    from train.trainer import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(metrics_path) if r["split"] == "train"}


def test_smoke_loss_finite_and_falls(tmp_path, split):
    from train.trainer import read_metrics, train

    cfg = small_config(tmp_path, "smoke", steps=16, lr=1e-2, eval_every=8, checkpoint_every=100)
    result = train(cfg, progress=False, plot=True, data_split=split)
    losses = _train_losses(result.metrics_path)
    assert sorted(losses) == list(range(1, 17))
    assert all(np.isfinite(v) for v in losses.values())
    assert np.mean([losses[s] for s in (14, 15, 16)]) < np.mean([losses[s] for s in (1, 2, 3)]) - 0.5
    val = [r for r in read_metrics(result.metrics_path) if r["split"] == "val"]
    assert [r["step"] for r in val] == [0, 8, 16] and val[-1]["val_loss"] < val[0]["val_loss"]
    assert result.plot_path.exists() and result.checkpoint_path.exists()
    train_rec = [r for r in read_metrics(result.metrics_path) if r["split"] == "train"][-1]
    assert train_rec["tokens_per_s"] > 0 and train_rec["dropped_rows"] == 0  # top-K drops nothing


@pytest.mark.parametrize("routing, rounding", [("token_rounding", "stochastic")])
def test_resume_gives_identical_next_steps(tmp_path, split, routing, rounding):
    """Stop at step 5, resume from the checkpoint: steps 6.. match an uninterrupted run bit for bit.

    Stochastic token rounding draws from the model's RNG stream each step, so this also
    checks that the RNG state travels with the checkpoint.
    """
    from train.trainer import train

    common = dict(steps=9, routing=routing, rounding=rounding, eval_every=100, checkpoint_every=100)
    full = train(small_config(tmp_path, "full", **common), progress=False, plot=False, data_split=split)
    cfg = small_config(tmp_path, "resumed", **common)
    part = train(cfg, progress=False, plot=False, stop_at=5, data_split=split)
    assert part.final_step == 5 and part.checkpoint_path.name == "5"
    resumed = train(cfg, resume=True, progress=False, plot=False, data_split=split)
    want, got = _train_losses(full.metrics_path), _train_losses(resumed.metrics_path)
    assert sorted(got) == list(range(1, 10))  # steps past the checkpoint were not duplicated
    assert got == want
    assert resumed.final_val == full.final_val


def test_resume_rejects_changed_model(tmp_path, split):
    from train.trainer import train

    # steps=6: the schedule of test_train_reliability's runs (RUN), so this train step is the
    # program they compile (the test stops at step 2 either way).
    cfg = small_config(tmp_path, "r", steps=6, eval_every=100, checkpoint_every=100)
    train(cfg, progress=False, plot=False, stop_at=2, data_split=split)
    with pytest.raises(ValueError, match="d_expert"):
        train(with_overrides(cfg, d_expert=64), resume=True, progress=False, plot=False, data_split=split)


def test_resume_accepts_retired_fields_at_their_retired_value():
    """A checkpoint written before a config field was removed (session 36: comm_sms) saved
    that field: it resumes at the value that trains as the code does now, and only there."""
    from train.trainer import RETIRED_FIELDS, config_changes

    cfg = get_config("tiny")
    saved = {**cfg.to_dict(), "comm_sms": 0}
    assert RETIRED_FIELDS == {"comm_sms": 0} and config_changes(saved, cfg) == set()
    assert config_changes({**saved, "comm_sms": 8}, cfg) == {"comm_sms"}
    assert config_changes({**saved, "d_expert": 64, "steps": 7}, cfg) == {"d_expert"}


def test_cli_prints_outputs(tmp_path, capsys):
    from train.main import main

    args = ["--config", "tiny", "--steps", "3", "--out", str(tmp_path / "cli"), "--no-progress",
            "--routing", "token_rounding", "--eval-every", "3"]
    for key, value in {**SMALL, "positions": "learned", "tie_embeddings": False}.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    paths = {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.splitlines() if ":" in line}
    for key in ("metrics", "checkpoint", "plot", "summary"):
        assert pathlib.Path(paths[key]).exists(), (key, out)
    summary = json.loads(pathlib.Path(paths["summary"]).read_text())
    assert summary["final_step"] == 3 and set(summary["final_val"]) == {"val_loss", "val_loss_topk"}
