"""The one logger every GPU benchmark writes: a line to stdout and to a log file under --out."""

from __future__ import annotations

import os
from typing import Callable

import jax


def open_log(out_dir: str, filename: str) -> Callable[[str], None]:
    """Creates `out_dir`, opens `out_dir/filename`, logs the device and jax version first.

    Returns `log(msg)`: prints `msg` (flushed: the device tool reads the tail of stdout) and
    appends it to the file.
    """
    os.makedirs(out_dir, exist_ok=True)
    log_file = open(os.path.join(out_dir, filename), "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    log(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    return log


def markdown_report(title: str, timing: str, cmd: str, notes: str, cols, results,
                    failed_row: Callable[[dict], str]) -> list[str]:
    """The lines of a benchmark's markdown report: title, date, jax version, how it was
    timed, the command that reproduces it, what the columns mean, and one table row per
    result (`cols`: (header, fn(result) -> cell)). A result missing a column (a failed
    case) is written by `failed_row(result)` instead."""
    import datetime

    lines = [
        f"# {title}",
        "",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}. "
        f"jax {jax.__version__}. {timing}",
        "",
        f"Reproduce: `{cmd}`",
        "",
        notes,
        "",
        "| " + " | ".join(c for c, _ in cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in results:
        try:
            lines.append("| " + " | ".join(f(r) for _, f in cols) + " |")
        except KeyError:
            lines.append(failed_row(r))
    return lines
