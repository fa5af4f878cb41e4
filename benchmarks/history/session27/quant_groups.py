"""Session 27: the SmoothQuant CSR kernel's grouped rows (`rows_per_reduction`: R rows'
maxima in one cross-warp exchange) and `no_auto_barriers`, against today's default, same
run, with session 25's harness (`quant_ab.py`: poisoned outputs, bitwise against the first
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

ALL = {
    "cur": {},  # a row at a time, Warpgroup semantics, auto barriers (the default)
    "nab": dict(no_auto_barriers=True),
    "g1": dict(rows_per_reduction=1, no_auto_barriers=True),
    "g2": dict(rows_per_reduction=2, no_auto_barriers=True),
    "g4": dict(rows_per_reduction=4, no_auto_barriers=True),
    "g8": dict(rows_per_reduction=8, no_auto_barriers=True),
    "g4ab": dict(rows_per_reduction=4),
    "g4bt2": dict(rows_per_reduction=4, no_auto_barriers=True, block_t=2),
    # call 4: the row loop in Lane semantics (every other kernel's), auto barriers off,
    # scale rows one row ahead or loaded with their own row (fewer registers).
    "lane1": dict(lane=True, no_auto_barriers=True),
    "lane0": dict(lane=True, no_auto_barriers=True, scale_rows_ahead=0),
    "lane1bt2": dict(lane=True, no_auto_barriers=True, block_t=2),
    "lane0bt2": dict(lane=True, no_auto_barriers=True, scale_rows_ahead=0, block_t=2),
}
qa.VERSIONS = {v: (cur, ALL[v]) for v in
               os.environ.get("QUANT_GROUPS", ",".join(ALL)).split(",")}

if __name__ == "__main__":
    qa.main(sys.argv[1], sys.argv[2].split(","))
