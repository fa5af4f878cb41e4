"""Real text with no download: the Python standard library's own source, as bytes.

Every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages excluded) is read
as raw bytes; each byte is a token (vocab 256). Files are split into train and validation
**by file**, deterministically: a file is held out when the SHA-1 of its path relative to the
stdlib root, read as a number, falls in the first `val_percent` percent. Files are joined in
sorted path order, each followed by a NUL byte (0 never occurs in source text) as a
document separator.

Training batches are non-overlapping windows of `seq_len + 1` bytes (stride `seq_len`),
shuffled once per epoch with a seed derived from (seed, epoch). The loader's whole state
is `(epoch, cursor)`, so a checkpoint that stores it resumes on exactly the next batch.
Validation uses a fixed set of windows spread evenly over the validation split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sysconfig

import numpy as np

SEPARATOR = 0  # byte between files


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Sorted relative paths of the stdlib's `*.py` files, without site/dist-packages."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in ("site-packages", "dist-packages") for part in rel.parts):
            continue
        files.append(rel)
    return sorted(files, key=lambda p: p.as_posix())


def is_validation(rel_path: pathlib.Path, val_percent: float) -> bool:
    """Deterministic split by file: hash of the relative path, not of the contents."""
    digest = hashlib.sha1(rel_path.as_posix().encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100 < val_percent


def load_split(val_percent: float, root: pathlib.Path | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Reads the stdlib and returns (train bytes u8[N], validation bytes u8[M], info)."""
    root = root or stdlib_root()
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for rel in stdlib_files(root):
        try:
            text = (root / rel).read_bytes()
        except OSError:
            continue
        parts["val" if is_validation(rel, val_percent) else "train"].append(text + bytes([SEPARATOR]))
    if not parts["train"] or not parts["val"]:
        raise RuntimeError(
            f"the stdlib at {root} gave {len(parts['train'])} train and {len(parts['val'])} "
            f"validation files (val_percent={val_percent}); need at least one of each."
        )
    train = np.frombuffer(b"".join(parts["train"]), np.uint8)
    val = np.frombuffer(b"".join(parts["val"]), np.uint8)
    info = {
        "stdlib": str(root),
        "train_files": len(parts["train"]),
        "val_files": len(parts["val"]),
        "train_bytes": int(train.size),
        "val_bytes": int(val.size),
    }
    return train, val, info


@dataclasses.dataclass
class Batches:
    """Shuffled non-overlapping windows over a byte stream; resumable via `state`.

    Each batch is `u8[batch_size, seq_len + 1]`; inputs are `[:, :-1]`, targets `[:, 1:]`.
    """

    data: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    epoch: int = 0
    cursor: int = 0  # windows of this epoch already served

    def __post_init__(self):
        self.num_windows = (self.data.size - 1) // self.seq_len
        if self.num_windows < self.batch_size:
            raise ValueError(
                f"the training split has {self.num_windows} windows of seq_len={self.seq_len}, "
                f"fewer than batch_size={self.batch_size}."
            )
        self._order_epoch = None
        self._order = None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(self.num_windows)
            self._order_epoch = self.epoch
        return self._order

    def next(self) -> np.ndarray:
        if self.cursor + self.batch_size > self.num_windows:  # drop the ragged tail of an epoch
            self.epoch, self.cursor = self.epoch + 1, 0
        windows = self._epoch_order()[self.cursor : self.cursor + self.batch_size]  # [B]
        self.cursor += self.batch_size
        starts = windows * self.seq_len  # [B]
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]  # [B, S+1]
        return self.data[idx]

    def state(self) -> dict:
        return {"epoch": int(self.epoch), "cursor": int(self.cursor), "seed": int(self.seed)}

    def restore(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"data state was saved with seed {state['seed']}, loader has {self.seed}.")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def validation_batches(data: np.ndarray, batch_size: int, seq_len: int, num_batches: int) -> list[np.ndarray]:
    """A fixed list of `u8[batch_size, seq_len + 1]` windows spread evenly over `data`."""
    count = batch_size * num_batches
    last_start = data.size - (seq_len + 1)
    if last_start < 0:
        raise ValueError(f"the validation split ({data.size} bytes) is shorter than seq_len + 1.")
    starts = np.linspace(0, last_start, count).astype(np.int64)  # [count]
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # [count, S+1]
    windows = data[idx]
    return [windows[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]
