# GPU calls of session 63: `bash benchmarks/history/session63/next_calls.sh PART` from the
# repo root; logs under $OUT.
#   A (~7 min, H100): issue 9: the new default (dH split with dA' in bf16 from d >= 2048)
#      through its GPU tests, then the step against the previous defaults (`split-dh-f32`:
#      30B's from session 60 to 62; `fused-dh`: Qwen3 widths'), paired over 3 rounds.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-A}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
case "$PART" in
A)
  timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "dh_split or backward_cp_async or empty_experts_on_gpu" > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_tests.log
  timeout 380 python3 benchmarks/step.py --shapes ${SHAPES:-qwen3-30b-a3b,30b} \
    --variants topk/cp_async,topk/cp_async/split-dh-f32,topk/cp_async/fused-dh --rounds 3 \
    --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | grep -v "^ *{" | cut -c1-400 | tail -14
  grep "^|" $OUT/step.log | tail -8 ;;
esac
