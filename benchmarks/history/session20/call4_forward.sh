# Session 20, call 4: the forward on the new default at 7B (ping-pong up-proj) with its
# baselines; forward and gradients against xla with token rounding and the exact exp.
set -x
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/forward.py --out $OUT --shapes 7b --up-sweep pingpong --down-sweep none --skew "" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -30
PYTHONPATH=. timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla and (1-True-token_rounding or 2-False-topk)" 2>&1 | tail -4 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
