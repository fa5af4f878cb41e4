# Session 23, call 4 (H200): the persistent weight gradients (issue 9). Call 3 put 174 us of
# dW1's 542 and 84 of dW2's 289 in per-tile cost at 7B. Check (bitwise vs the default, XLA
# reference, poisoned outputs, NaN padding rows), time, then the 7B step with them.
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/history/session23/wg_persistent.py 7b,7b-skew,30b 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/wg_persistent.txt | tail -22
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 240 python3 benchmarks/step.py --out $OUT --shapes 7b --variants topk/cp_async,topk/cp_async/persistent-wg,topk/cp_async 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -8
