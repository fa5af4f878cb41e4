# Session 26, call 4 (issue 9; planned in session 25): where the persistent 4-stage weight gradients'
# time goes at 7B and 30B (the step's largest gap to its bound at 30B: dW1 + dW2 7.05 ms
# against ~4.2). Ablations, same run: no group-edge masking, no stores, feed alone (nomma),
# wgmmas alone (nofeed). See wg_ablate.py's docstring for how to read it.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 400 python3 benchmarks/history/session25/wg_ablate.py 7b,30b 2>&1 | grep "^|"
