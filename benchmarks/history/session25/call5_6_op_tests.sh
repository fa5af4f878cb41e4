# Session 25, calls 5 and 6 (H200): the op against the xla backend on the H200's new
# defaults (persistent 4-stage weight gradients; split-M up-proj at d = 2048): forward,
# gradients, bitwise repeat. Call 5 (330-s limit) passed 5 of the 7 cases before the limit
# cut it; call 6 ran the two 2-False cases and the d = 2048 case.
export PYTHONPATH=.
# call 5:
timeout 330 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla" 2>&1 | tail -4
# call 6:
timeout 280 python3 -m pytest -p no:xdist -q -rA -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla_at_d_2048 or 2-False" 2>&1 | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -6
