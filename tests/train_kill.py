"""Trains a small config and SIGKILLs itself in the middle of a write, for the resume tests.

    python -m tests.train_kill --out DIR --kill metrics --step 3 [--set FIELD=VALUE ...]
    python -m tests.train_kill --out DIR --kill checkpoint --step 4 [--set FIELD=VALUE ...]

`metrics`: the train record of step N is half written (no newline) when the process dies,
as a kill between two `write` calls of one line would leave it. `checkpoint`: step N's
checkpoint has all its files written under orbax's temporary directory and dies just
before the commit (the rename to `<step>/`). SIGKILL runs no handler and no `finally`,
exactly like the OOM killer or a preempted machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_mid_metrics_line(step: int) -> None:
    from train import trainer

    write = trainer.MetricsLog.write

    def torn_write(self, record):
        if record.get("split") == "train" and record.get("step") == step:
            line = json.dumps(record) + "\n"
            with self.path.open("a") as f:
                f.write(line[: len(line) // 2])
            die()
        write(self, record)

    trainer.MetricsLog.write = torn_write


def kill_before_checkpoint_commit(step: int) -> None:
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_or_die(self, *args, **kwargs):
        if self.get_final().name == str(step):
            die()
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill", choices=("metrics", "checkpoint"), required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    args = p.parse_args(argv)

    from train.configs import get_config, with_overrides
    from train.main import parse_set
    from train.trainer import train

    base = get_config("tiny")
    cfg = with_overrides(base, **parse_set(args.set, base), out=args.out)
    if args.kill == "metrics":
        kill_mid_metrics_line(args.step)
    else:
        kill_before_checkpoint_commit(args.step)
    train(cfg, progress=False, plot=False)
    print("finished without being killed", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
