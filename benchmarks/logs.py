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
