"""python -m train.quant_eval: validation loss of a trained model with fp8 MoE layers.

Loads a train run (`--checkpoint runs/small`) or trains one first (`--config small
--train-steps 3000`), then evaluates the same validation windows under three settings:

    as trained   the run's own dtype and backend
    bf16         bfloat16 compute, every MoE layer on `pm.moe_ffn` (`--backend`)
    fp8          bfloat16 compute, every MoE layer's routed experts in e4m3
                 (`pm.nn.MoE.quantize_fp8`: `pm.quant.moe_ffn_fp8`, no smoothing)

and writes `quant_eval.json` and `quant_eval.md` (a table: loss, loss - bf16's, relative
error of the logits against bf16) under `--out`. On a Hopper GPU `--backend auto` runs the
Mosaic kernels (bf16 and fp8); elsewhere the jnp references of the same steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    from train.parity import add_model_args

    p = argparse.ArgumentParser(prog="python -m train.quant_eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, config="small", train_steps=3000)
    p.add_argument("--backend", default="auto", help="MoE backend of the bf16 and fp8 settings")
    p.add_argument("--batches", type=int, help="validation batches (default: the config's eval_batches)")
    p.add_argument("--out", default="runs/quant_eval", help="output directory")
    return p.parse_args(argv)


def evaluate(cfg, params, batches, *, fp8: bool) -> tuple[float, list]:
    """Mean cross-entropy over `batches` (u8[B, S+1] each) of the model `cfg` builds with
    `params`, its MoE layers quantized to e4m3 first if `fp8`; also each batch's logits."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from train.model import MoETransformer
    from train.trainer import cross_entropy

    model = MoETransformer(cfg, rngs=nnx.Rngs(0))
    graphdef, fresh, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.structure(fresh) != jax.tree.structure(params):
        raise ValueError("the checkpoint's parameters do not fit the evaluation model.")
    model = nnx.merge(graphdef, params, rest)
    if fp8:
        for block in model.blocks:
            block.moe.quantize_fp8()
    graphdef, state = nnx.split(model)

    @jax.jit
    def loss_and_logits(state, batch):
        batch = batch.astype(jnp.int32)  # [B, S+1]
        logits, _ = nnx.merge(graphdef, state)(batch[:, :-1])  # [B, S, V]
        return cross_entropy(logits, batch[:, 1:]), logits

    losses, logits = [], []
    for batch in batches:
        loss, out = loss_and_logits(state, batch)
        losses.append(float(loss))
        logits.append(np.asarray(out, np.float32))
    return float(np.mean(losses)), logits


def run(args) -> dict:
    import jax
    import numpy as np

    from train import data
    from train.parity import load_model

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, params, source = load_model(args, out_dir)
    _, val_bytes, _ = data.load_split(cfg.val_percent)
    num_batches = args.batches or cfg.eval_batches
    batches = data.validation_batches(val_bytes, cfg.batch_size, cfg.seq_len, num_batches)
    low = dataclasses.replace(cfg, dtype="bfloat16", backend=args.backend)
    settings = {
        "as trained": (cfg, False),
        "bf16": (low, False),
        "fp8": (low, True),
    }
    rows, logits, timings = {}, {}, {}
    for name, (setting_cfg, fp8) in settings.items():
        t0 = time.perf_counter()
        loss, logits[name] = evaluate(setting_cfg, params, batches, fp8=fp8)
        timings[name] = round(time.perf_counter() - t0, 3)
        rows[name] = {"dtype": setting_cfg.dtype, "backend": setting_cfg.backend, "fp8": fp8,
                      "val_loss": loss}
    for name, row in rows.items():
        row["minus_bf16"] = row["val_loss"] - rows["bf16"]["val_loss"]
        diff = np.concatenate([(a - b).ravel() for a, b in zip(logits[name], logits["bf16"])])
        ref = np.concatenate([b.ravel() for b in logits["bf16"]])
        row["logits_rel_err_vs_bf16"] = float(np.linalg.norm(diff) / np.linalg.norm(ref))
    results = {
        "model": source, "config": cfg.to_dict(), "device": str(jax.devices()[0]),
        "validation_tokens": int(num_batches * cfg.batch_size * cfg.seq_len),
        "rows": rows, "timings_s": timings,
    }
    (out_dir / "quant_eval.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown_table(results)
    (out_dir / "quant_eval.md").write_text(table)
    results["table"] = table
    return results


def markdown_table(results: dict) -> str:
    lines = [
        f"Validation loss of {results['model']} on {results['device']}, "
        f"{results['validation_tokens']} validation tokens:",
        "",
        "| setting | dtype | MoE backend | val loss | minus bf16's | logits rel. err vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results["rows"].items():
        lines.append(
            f"| {name} | {row['dtype']} | {row['backend']}{' (fp8 experts)' if row['fp8'] else ''} "
            f"| {row['val_loss']:.4f} | {row['minus_bf16']:+.4f} | {row['logits_rel_err_vs_bf16']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(results["table"], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
