"""Routing ablation: the same model, seed and data with token-choice top-K and with token rounding.

    python -m train.ablation --config tiny                       # topk vs TR(nearest), CPU ~6 min
    python -m train.ablation --config tiny --roundings nearest,up,down --steps 300

Each variant trains in `<out>/<variant>/` (metrics.jsonl, checkpoints, loss.png). The
comparison goes to `<out>/comparison.{md,json,png}`: validation-loss curves, final
validation loss, training tokens/s, and routing statistics over training: top-K rows that
token rounding dropped, non-top-K rows it added, and the grouped-GEMM padding waste at the
tile `M_tile` for the routed plan and for plain top-K routing of the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import numpy as np

from train.configs import ROUNDINGS, Config, ConfigError, get_config, with_overrides


def variants(cfg: Config, roundings: list[str]) -> dict[str, Config]:
    out = {"topk": dataclasses.replace(cfg, routing="topk")}
    for r in roundings:
        out[f"tr_{r}"] = dataclasses.replace(cfg, routing="token_rounding", rounding=r)
    return out


def tokens_per_expert(cfg: Config) -> float:
    """Mean top-K rows per expert in one MoE layer call: T*K/E with T = batch * seq."""
    return cfg.tokens_per_step * cfg.top_k / cfg.num_experts


def summarize(name: str, cfg: Config, metrics: list[dict], train_summary: dict) -> dict:
    train = [r for r in metrics if r.get("split") == "train"]
    val = [r for r in metrics if r.get("split") == "val"]
    last = train[-max(1, len(train) // 10):]  # last 10% of logged intervals
    mean = lambda rows, key: float(np.mean([r[key] for r in rows])) if rows and key in rows[0] else float("nan")
    row = {
        "variant": name,
        "routing": cfg.routing,
        "rounding": cfg.rounding if cfg.routing == "token_rounding" else "-",
        "final_val_loss": val[-1]["val_loss"],
        "final_val_loss_topk_routing": val[-1].get("val_loss_topk", float("nan")),
        "best_val_loss": min(r["val_loss"] for r in val),
        "final_train_ce": mean(last, "ce"),
        "train_tokens_per_s": train_summary["train_tokens_per_s"],
        "dropped_rows_per_step": mean(train, "dropped_rows"),
        "added_rows_per_step": mean(train, "added_rows"),
        "padding_fraction": mean(train, "padding_fraction"),
        "tc_padding_fraction": mean(train, "tc_padding_fraction"),
        "max_load": mean(train, "max_load"),
        "routed_rows_per_step": cfg.tokens_per_step * cfg.top_k * cfg.num_layers,
    }
    return row


def markdown_table(rows: list[dict]) -> str:
    head = ("| variant | final val loss | val loss, top-K routing | train CE (last 10%) | train tokens/s "
            "| dropped rows/step | added rows/step | padding waste (plan) | padding waste (top-K) | max/mean load |")
    sep = "|" + "---|" * 10
    lines = [head, sep]
    for r in rows:
        topk_val = r["final_val_loss_topk_routing"]
        lines.append(
            f"| {r['variant']} | {r['final_val_loss']:.4f} | "
            f"{'-' if np.isnan(topk_val) else f'{topk_val:.4f}'} | {r['final_train_ce']:.4f} | "
            f"{r['train_tokens_per_s']:,.0f} | {r['dropped_rows_per_step']:.1f} | "
            f"{r['added_rows_per_step']:.1f} | {100 * r['padding_fraction']:.2f}% | "
            f"{100 * r['tc_padding_fraction']:.2f}% | {r['max_load']:.3f} |"
        )
    return "\n".join(lines)


def plot_comparison(runs: dict[str, list[dict]], path: pathlib.Path, title: str) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for name, metrics in runs.items():
        val = [r for r in metrics if r.get("split") == "val"]
        train = [r for r in metrics if r.get("split") == "train"]
        line, = axes[0].plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", ms=3, label=name)
        if val and "val_loss_topk" in val[0]:
            axes[0].plot([r["step"] for r in val], [r["val_loss_topk"] for r in val], "--",
                         color=line.get_color(), label=f"{name}, eval with top-K")
        steps = [r["step"] for r in train]
        axes[1].plot(steps, [100 * r.get("padding_fraction", np.nan) for r in train], color=line.get_color(),
                     label=f"{name}: routed plan")
        if name == "topk" or len(runs) <= 3:
            axes[1].plot(steps, [100 * r.get("tc_padding_fraction", np.nan) for r in train], ":",
                         color=line.get_color(), label=f"{name}: plain top-K of same tokens")
        if name != "topk":
            axes[2].plot(steps, [r.get("dropped_rows", np.nan) for r in train], color=line.get_color(),
                         label=f"{name}: dropped top-K rows")
            axes[2].plot(steps, [r.get("added_rows", np.nan) for r in train], "--", color=line.get_color(),
                         label=f"{name}: added rows")
    val_losses = [r["val_loss"] for m in runs.values() for r in m if r.get("split") == "val" and r["step"] > 0]
    if val_losses:
        lo, hi = min(val_losses), max(val_losses)
        axes[0].set_ylim(lo - 0.05 * (hi - lo + 1e-3), min(hi, lo + 2.0))  # skip the init spike
    axes[0].set(title="validation loss", xlabel="step", ylabel="nats per byte")
    axes[1].set(title="grouped-GEMM padding waste (% of padded rows)", xlabel="step", ylabel="%")
    axes[2].set(title="rows changed by token rounding (per step, all layers)", xlabel="step", ylabel="rows")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(cfg: Config, roundings: list[str], out: pathlib.Path, progress: bool = True, overwrite: bool = False) -> dict:
    from train import data
    from train.trainer import read_metrics, train

    out.mkdir(parents=True, exist_ok=True)
    split = data.load_split(cfg.val_percent)  # read once, shared by every variant
    ratio = tokens_per_expert(cfg) / cfg.tile
    print(f"tokens per expert per layer call T*K/E = {tokens_per_expert(cfg):.0f}, tile = {cfg.tile}, "
          f"ratio = {ratio:.2f}" + ("" if 2 <= ratio <= 4 else "  (outside the 2-4 range asked for)"), flush=True)
    rows, runs = [], {}
    for name, vcfg in variants(cfg, roundings).items():
        vcfg = dataclasses.replace(vcfg, out=str(out / name), name=f"{cfg.name}-{name}")
        print(f"== {name}: routing={vcfg.routing}" + (f" rounding={vcfg.rounding}" if name != "topk" else ""), flush=True)
        result = train(vcfg, progress=progress, data_split=split, overwrite=overwrite)
        metrics = read_metrics(result.metrics_path)
        runs[name] = metrics
        rows.append(summarize(name, vcfg, metrics, result.summary))
        print(f"   final val loss {rows[-1]['final_val_loss']:.4f}, {rows[-1]['train_tokens_per_s']:,.0f} tokens/s",
              flush=True)
    title = (f"{cfg.name}: d={cfg.d_model} L={cfg.num_layers} E={cfg.num_experts} K={cfg.top_k} "
             f"T={cfg.tokens_per_step} tile={cfg.tile} (T*K/E/tile={ratio:.1f}), {cfg.steps} steps, seed {cfg.seed}")
    plot = plot_comparison(runs, out / "comparison.png", title)
    table = markdown_table(rows)
    (out / "comparison.md").write_text(f"{title}\n\n{table}\n\nplot: {plot}\n")
    (out / "comparison.json").write_text(json.dumps(
        {"config": cfg.to_dict(), "tokens_per_expert": tokens_per_expert(cfg), "ratio": ratio, "rows": rows},
        indent=2) + "\n")
    print(table)
    print(f"comparison: {out / 'comparison.md'}\nplot:       {plot}\ndata:       {out / 'comparison.json'}")
    return {"rows": rows, "plot": plot, "table": table}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny")
    p.add_argument("--roundings", default="nearest", help=f"comma-separated token rounding modes from {ROUNDINGS}")
    p.add_argument("--steps", type=int)
    p.add_argument("--tile", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--backend", help="moe_ffn backend: auto, mosaic, interpret, xla")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any config field (repeatable)")
    p.add_argument("--out", help="default runs/ablation_<config>")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace the variants' previous runs under --out")
    args = p.parse_args(argv)
    try:
        from train.main import parse_set

        base = get_config(args.config)
        cfg = with_overrides(base, **{**parse_set(args.set, base), "steps": args.steps, "tile": args.tile,
                                      "seed": args.seed, "backend": args.backend})
        roundings = [r.strip() for r in args.roundings.split(",") if r.strip()]
        for r in roundings:
            with_overrides(cfg, routing="token_rounding", rounding=r)
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out or f"runs/ablation_{cfg.name}")
    from train.trainer import RunDirError

    try:
        run(cfg, roundings, out, progress=not args.no_progress, overwrite=args.overwrite)
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
