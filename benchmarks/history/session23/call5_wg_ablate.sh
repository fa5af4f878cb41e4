# Session 23, call 5 (H200): what the weight gradients' per-tile cost is made of, after the
# persistent kernel (call 4) hid none of it: the group-edge masking and the stores, ablated.
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/history/session23/wg_ablate.py 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/wg_ablate.txt | tail -16
