# Session 20, call 6: where the ping-pong up-proj's time goes at 7B (the default there now):
# its timeline and epilogue ablations (CUPTI, same run), against the cooperative kernel.
set -x
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels up,up_nostore,up_noepilogue,up_coop 2>&1 | grep -v "Warn\|warn" | tail -75
