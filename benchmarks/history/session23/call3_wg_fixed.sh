# Session 23, call 3 (H200): the weight gradients' per-tile (fixed) cost, before building a
# persistent weight-gradient kernel (issue 9): dW1 / dW2 at T = 24576, 12288, 6144 (7B widths).
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 400 python3 benchmarks/history/session23/wg_fixed.py 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/wg_fixed.txt | tail -24
