# GPU calls prepared in session 62 for the next session: `bash
# benchmarks/history/session62/next_calls.sh PART` from the repo root; logs under $OUT.
# (Session 62 ran session 61's parts E, G and F: `history/session61/next_calls.sh`.)
#   H (~4 min, H100): issue 9: the split dH with dA' in bf16 (`BackwardConfig.dh_da_dtype`,
#      built in session 62, never on a GPU) against the f32 split and the fused kernel,
#      paired, at 30B, Qwen3-30B-A3B widths and 7B (`history/session62/dh_bf16_da.py`; the
#      prediction is in its docstring), then its GPU test (bitwise the row pass on the
#      rounded f32 dA', at three widths).
#   I (~5 min, H100): issue 9: if H's bf16 split wins somewhere, the training step with it
#      (`split-dh-bf16`) against the default, paired, at `SHAPES` (default
#      qwen3-30b-a3b,30b).
#   J (~5 min, H100): issue 9: the step at (32768, 4096, 1024, 64, 4) with the split dH (the
#      default) against the fused dH, paired: session 62's call 10 timed the whole backward
#      once each and found the fused one 1.049x faster, against its kernels' sum.
#   K (~5 min, H100): README rows measured before session 61's down-proj rule: the steps at
#      (24576, 1536, 1024, 32, 2) and (32768, 4096, 1024, 128, 8), default against
#      `pingpong-down` (the old default), paired.
# H first (the only unmeasured build), then J, then I if H says so, then K.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-H}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
case "$PART" in
H)
  timeout 330 python3 benchmarks/history/session62/dh_bf16_da.py 30b,qwen3-30b-a3b,7b 2 \
    > $OUT/dh_bf16_da.log 2>&1
  echo "dh_bf16_da rc=$? at $(( $(date +%s) - T0 )) s"; tail -16 $OUT/dh_bf16_da.log | cut -c1-300
  timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "bf16_da" \
    > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_tests.log ;;
I)
  timeout 500 python3 benchmarks/step.py --shapes ${SHAPES:-qwen3-30b-a3b,30b} \
    --variants topk/cp_async,topk/cp_async/split-dh-bf16 --rounds 2 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | cut -c1-700 | tail -12
  grep "^|" $OUT/step.log | tail -6 ;;
J)
  timeout 500 python3 benchmarks/step.py --shapes 30b-n1024 \
    --variants topk/cp_async,topk/cp_async/fused-dh --rounds 3 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | cut -c1-700 | tail -12
  grep "^|" $OUT/step.log | tail -6 ;;
K)
  timeout 500 python3 benchmarks/step.py --shapes 7b-n1024,120b \
    --variants topk/cp_async,topk/cp_async/pingpong-down --rounds 2 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | cut -c1-700 | tail -12
  grep "^|" $OUT/step.log | tail -6 ;;
esac
