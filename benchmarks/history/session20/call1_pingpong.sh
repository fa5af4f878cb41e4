# Session 20, call 1: the ping-pong up-proj: GPU tests, the same-run sweep, a timeline.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
PYTHONPATH=. timeout 200 python3 -m pytest -p no:xdist -q -m gpu -x tests/test_gpu.py -k "pingpong" 2>&1 | tail -15 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 260 python3 benchmarks/history/session20/pingpong_up.py 7b,30b 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/pingpong_up.txt
tail -30 $OUT/pingpong_up.txt
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 100 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels up,up_pingpong 2>&1 | tail -45
