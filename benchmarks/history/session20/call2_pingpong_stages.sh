# Session 20, call 2: the ping-pong up-proj with 5 stages and a one-tile epilogue buffer.
set -x
PYTHONPATH=. timeout 190 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "pingpong" 2>&1 | tail -15 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 270 python3 benchmarks/history/session20/pingpong_up.py 7b,30b 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/pingpong_up.txt
tail -22 $OUT/pingpong_up.txt
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 90 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels up_pingpong 2>&1 | grep -v Warn | tail -22
