"""Session 26 (issue 13): smooth-scale rows through SMEM slots filled by TMA
(`SmoothQuantConfig.scale_stages`) against the default (scale rows in registers, one row
ahead), same run, with session 25's A/B harness (`session25/quant_ab.py`: poisoned outputs,
bitwise against the first version, 4096 rows against numpy, `of copy` = the bytes the op
must move per second over a same-run device copy's).

Why: the kernel reads 7.4-8.2 TB/s of scale rows from L2 (call 6's probe: 16 TB/s is
there), and scale rows 2-3 ahead in registers were 0.63-0.81x (call 3): each in-flight row
costs `d / 128` registers per thread, which limits CTAs per SM. In SMEM the rows in flight
cost none.

Needs commit c851d0a (the option was removed after this call: 0.79-0.95x).

    PYTHONPATH=. python3 benchmarks/history/session26/quant_smem.py OUT 7b,30b
"""
import importlib.util
import os
import sys

sys.path.insert(0, ".")
spec = importlib.util.spec_from_file_location(
    "quant_ab", os.path.join(os.path.dirname(__file__), "..", "session25", "quant_ab.py"))
quant_ab = importlib.util.module_from_spec(spec)
sys.modules["quant_ab"] = quant_ab
spec.loader.exec_module(quant_ab)
cur = quant_ab.cur

quant_ab.VERSIONS = {
    "cur": (cur, {}),
    "smem1": (cur, dict(scale_stages=1)),
    "smem2": (cur, dict(scale_stages=2)),
    "smem3": (cur, dict(scale_stages=3)),
    "smem2_bt2": (cur, dict(scale_stages=2, block_t=2)),
    "smem4": (cur, dict(scale_stages=4)),
}

if __name__ == "__main__":
    quant_ab.main(sys.argv[1], sys.argv[2].split(","))
