"""Session 27: the SmoothQuant CSR kernel's variants against session 26's, same run, with session 25's harness (`quant_ab.py`: poisoned outputs, bitwise against the first
version, 4096 rows against numpy, fraction of a same-run device copy).

    PYTHONPATH=. python3 benchmarks/history/session27/quant_groups.py OUT 7b,30b
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

def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(__file__), name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


# Calls 3 and 4 ran this script at commits 970ebde and c4276e2, whose SmoothQuantConfig had
# the A/B fields `rows_per_reduction` (grouped rows, R = 1, 2, 4, 8 -> "g1".."g8"),
# `no_auto_barriers` ("nab") and `lane` (the WG_STRIDED row loop in Lane semantics,
# "lane1"/"lane0" = 1 or 0 scale rows ahead). Call 5 compares session 26's kernel with the
# kept form (TILED [1, d] rows, Lane semantics, no auto barriers):
ALL = {
    "s26": (_load("smoothquant_s26"), {}),
    "new": (cur, {}),  # defaults: 1 scale row ahead up to d = 2048, 0 above
    "ahead1": (cur, dict(scale_rows_ahead=1)),
    "ahead0": (cur, dict(scale_rows_ahead=0)),
    "ahead1bt2": (cur, dict(scale_rows_ahead=1, block_t=2)),
    # call 7 (at commit 4ebcfd0; the code is staged_scale_rows.patch, removed after it measured
    # 0.60-0.95x): scale rows staged in SMEM by each thread's own cp.async loads
    "staged1": (cur, dict(staged_scale_rows=1)),
    "staged2": (cur, dict(staged_scale_rows=2)),
    "staged1bt2": (cur, dict(staged_scale_rows=1, block_t=2)),
}
qa.SHAPES["qwen3"] = (32768, 2048, 128, 8)  # the Qwen3-30B-A3B width: the default's edge
qa.VERSIONS = {v: ALL[v] for v in
               os.environ.get("QUANT_GROUPS", ",".join(ALL)).split(",")}

if __name__ == "__main__":
    qa.main(sys.argv[1], sys.argv[2].split(","))
