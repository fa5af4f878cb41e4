# Session 20, call 3: the ping-pong up-proj across widths; the 7B step on the new default;
# forward and gradients through the new default against xla.
set -x
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 280 python3 benchmarks/history/session20/pingpong_up.py 7b+skew,7b-n512,qwen3-30b-a3b,w2880,w7168,30b-n256 widths 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/widths.txt
tail -30 $OUT/widths.txt
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/step.py --shapes 7b --variants topk/cp_async --out $OUT/step 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -25
PYTHONPATH=. timeout 100 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla and 0-True-topk" 2>&1 | tail -4
