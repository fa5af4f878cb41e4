"""Session 28, prepared for the next GPU run (issue 13): the SmoothQuant CSR kernel with the
next row's scale row asked into L1 (`SmoothQuantConfig.prefetch_scale_rows`: one
`prefetch.global.L1` per 128-byte line, the expert ids one row further ahead) against the
default (the scale row loaded in its own iteration, session 27), same run, with session 25's
harness (`quant_ab.py`: poisoned outputs, bitwise against the first version, 4096 rows
against numpy, fraction of a same-run device copy).

    PYTHONPATH=. python3 benchmarks/history/session28/quant_prefetch.py OUT 7b,30b,qwen3

Hypothesis (session 27's sampling: at 30B 31% of the warps' samples wait on the scale
row's L2 load): the load then hits L1, without the registers a held row costs
(`scale_rows_ahead=1`: 133 instead of 96 registers at 30B, 3 CTAs per SM instead of 5).
"""
import importlib.util
import os
import sys

sys.path.insert(0, ".")
_spec = importlib.util.spec_from_file_location(
    "quant_ab", os.path.join(os.path.dirname(__file__), "..", "session25", "quant_ab.py"))
qa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qa)
from pallas_moe.quant import kernel as cur  # noqa: E402

ALL = {
    "default": (cur, {}),
    "prefetch": (cur, dict(prefetch_scale_rows=True)),
    "prefetch_ahead1": (cur, dict(prefetch_scale_rows=True, scale_rows_ahead=1)),
    "prefetch_bt2": (cur, dict(prefetch_scale_rows=True, block_t=2)),
}
qa.SHAPES["qwen3"] = (32768, 2048, 128, 8)  # the Qwen3-30B-A3B width
qa.VERSIONS = {v: ALL[v] for v in os.environ.get("QUANT_PREFETCH", ",".join(ALL)).split(",")}

if __name__ == "__main__":
    qa.main(sys.argv[1], sys.argv[2].split(","))
