"""Loss-curve plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from train.trainer import read_metrics  # noqa: E402


def _series(records: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in records if r.get("split") == split and key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]


def plot_run(metrics_path: str | pathlib.Path, out_path: str | pathlib.Path, title: str = "") -> pathlib.Path:
    """Train cross-entropy and validation loss against step, from one run's metrics.jsonl."""
    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(*_series(records, "train", "ce"), label="train cross-entropy", alpha=0.8)
    ax.plot(*_series(records, "val", "val_loss"), "o-", label="validation loss")
    steps, vals = _series(records, "val", "val_loss_topk")
    if steps:
        ax.plot(steps, vals, "s--", label="validation loss, top-K routing")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per byte")
    ax.set_title(title or "training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_path = pathlib.Path(out_path)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
