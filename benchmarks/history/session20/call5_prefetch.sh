# Session 20, call 5: the ping-pong up-proj with an L2 prefetch of the gathered rows.
set -x
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 330 python3 benchmarks/history/session20/pingpong_up.py 7b,qwen3-30b-a3b,30b prefetch 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/prefetch.txt
tail -20 $OUT/prefetch.txt
