"""Two training runs' metrics side by side (train loss and val loss per step), and the
largest relative difference: `python compare_runs.py RUN_A RUN_B` (directories holding
metrics.jsonl). Used to check the EP run against the one-GPU run."""
import sys

from train.trainer import read_metrics


def by_step(path, split, key):
    return {r["step"]: r[key] for r in read_metrics(f"{path}/metrics.jsonl") if r.get("split") == split and key in r}


a_dir, b_dir = sys.argv[1:3]
for split, key in (("train", "loss"), ("val", "val_loss"), ("train", "tokens_per_s")):
    a, b = by_step(a_dir, split, key), by_step(b_dir, split, key)
    steps = sorted(set(a) & set(b))
    if not steps:
        print(f"{split} {key}: no common steps ({len(a)} / {len(b)} records)")
        continue
    rel = [abs(a[s] - b[s]) / max(abs(a[s]), 1e-30) for s in steps]
    print(f"{split} {key}: {len(steps)} steps, max rel diff {max(rel):.2e} at step {steps[rel.index(max(rel))]}, "
          f"last step {steps[-1]}: {a[steps[-1]]:.6g} vs {b[steps[-1]]:.6g}")
    if key != "tokens_per_s":
        for s in steps[:: max(1, len(steps) // 8)]:
            print(f"  step {s}: {a[s]:.6f} {b[s]:.6f}")
