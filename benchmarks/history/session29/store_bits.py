"""Session 29: are the op's outputs and gradients (`moe_ffn`, backend="mosaic", the device's
defaults) the same bits with the row tiles stored by the warpgroup's own loads and stores
(`timeline.ablated("lsustore")`, `_common.lsu_store_row_tile`) as with the TMA stores? The
LSU form runs first, in a fresh process, so no output buffer can hold the TMA form's bits.

    PYTHONPATH=. python3 benchmarks/history/session29/store_bits.py [7b,30b]
"""
import importlib.util
import sys

import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.timeline import ablated  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "packed_bf16", "benchmarks/history/session28/packed_bf16.py")
packed_bf16 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(packed_bf16)


def main():
    failed = []
    for name in (sys.argv[1] if len(sys.argv) > 1 else "7b,30b").split(","):
        args, K = packed_bf16.case(name)
        with ablated("lsustore"):
            (_, out_l), grads_l = packed_bf16.step_fn(K)(*args)
        (_, out), grads = packed_bf16.step_fn(K)(*args)
        for what, a, b in zip(("out", "d_logits", "dx", "dw_gate_up", "dw_down"),
                              (out, *grads), (out_l, *grads_l)):
            same = bool(jnp.array_equal(a, b))
            finite = bool(jnp.all(jnp.isfinite(b.astype(jnp.float32))))
            print(f"{name} {what}: {'bitwise equal' if same else 'DIFFERS'} (finite: {finite})",
                  flush=True)
            if not same:
                failed.append(f"{name} {what}")
    if failed:
        raise SystemExit(f"LSU stores changed: {failed}")


if __name__ == "__main__":
    main()
