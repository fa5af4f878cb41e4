# Session 31, call 9 (same machine as call 8, warm): the same step with the ping-pong
# up-proj first. The second variant's profile aborted ("Mosaic GPU profiler error: activity
# records were dropped" after the trace); the first variant's figures came back.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 170 python3 benchmarks/step.py --out /tmp/st2 --shapes 7b-n512 \
  --variants topk/cp_async/pingpong-up,topk/cp_async --gaps > $OUT/step_gaps2.log 2>&1
grep "gpu_ms\|kernels (ms" $OUT/step_gaps2.log | cut -c1-400
