# Session 30, call 4 (issues 16 and 9). The whole layer step at the wide-expert 7B shapes with
# the split-M up-proj (the H200's new default at d <= 1536 from n = 512 on) against the
# ping-pong (the previous default), same run, with the kernel-by-kernel breakdown: what the
# forward gain gives the step, and how dH / dW1 / dX~ fare at wide experts.
export PYTHONPATH=. PYTHONUNBUFFERED=1
date
timeout 450 python3 benchmarks/step.py --out $OUT/step --shapes 7b-n512,7b-n1024 \
  --variants topk/cp_async,topk/cp_async/pingpong-up > $OUT/step_stdout.log 2>&1
date
cat $OUT/step/step.md 2>/dev/null | head -60
