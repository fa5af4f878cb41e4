# Session 31, call 8 (issues 16, 9): does anything run beside the up-proj inside the
# 7b-n512 step (split-M 0.59 ms there, 0.52 alone)? `step.py --gaps` now also lists kernels
# that ran side by side on different streams (`concurrent_kernels`).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 220 python3 benchmarks/step.py --out /tmp/st --shapes 7b-n512 --variants topk/cp_async \
  --gaps > $OUT/step_gaps.log 2>&1
grep -v "^ *$" $OUT/step_gaps.log | grep "gaps:\|kernels (ms\|gpu_ms" | cut -c1-3000
