# Session 23, call 6 (H200): the persistent weight gradients at 4 stages, their output tiles
# stored straight from registers (no SMEM tile, so the 4th stage fits; the stores are
# fire-and-forget under the next item's K loop). Checked and timed as in call 4.
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 400 python3 benchmarks/history/session23/wg_persistent.py 7b,30b,7b-skew --direct 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/wg_direct.txt | tail -22
