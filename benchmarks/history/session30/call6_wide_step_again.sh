# Session 30, call 6: call 4 again with the variants in the other order. Call 4 had the
# up-proj kernel inside the step at split-M 0.598 / 0.600 ms vs ping-pong 0.547 / 0.594
# (7b-n512 / 7b-n1024), while alone, on the same plans, split-M was 1.13x / 1.17x faster
# (call 5). Is it the order of the variants (clocks, heat) or the step's context?
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python3 benchmarks/step.py --out $OUT/step --shapes 7b-n512,7b-n1024 \
  --variants topk/cp_async/pingpong-up,topk/cp_async > $OUT/step_stdout.log 2>&1
grep "kernels (ms" $OUT/step/step_log.txt | sed 's/_mosaic_gpu_kernel//g' | cut -c1-200
cat $OUT/step/step.md | grep "^|"
