# GPU calls queued by session 64: `bash benchmarks/history/session64/next_calls.sh PART` from
# the repo root; logs under $OUT. (Session 64 ran session 63's queue from a copy of this file:
# A2, A3, B, F, E, H and half of G; its results are in `calls.md`.)
#   T (~9 min, H100, FIRST): the GPU tests of what session 64 changed and of what session 63's
#      A2 did not reach (it ran past its limit after 21 of 38 tests): the backward through
#      cp.async, the staged output slabs, the split dH, the persistent weight gradients (7B's
#      new 192-wide gathered chunks with 3 stages among them) and the grouped GEMM at the
#      other wgmma_lag (dX~'s new lag-0 default at gpt-oss widths). `-v`, so a cut run still
#      names each test that finished.
#   S (~6 min, H100): the 7B steps with the weight gradients' new 192-wide gathered chunks
#      against the previous tile (`wg-128`), 3 paired rounds, at 7b and 7b-n1024 (kernels
#      alone: dW2 1.021x, dW1 1.015x). Revert in `_gathered_chunks` if the step is slower
#      beyond the spread.
#   G (~5 min, H100): the gpt-oss-20b step (expert biases, clamped SwiGLU) with dX~'s new
#      lag 0 against `lag1-dx`, 3 paired rounds (dX~ alone 1.047x).
#   C (~6 min, H100): issue 9: the bf16-dA' split at the other d >= 4096 shapes, paired
#      against `split-dh-f32`: (32768, 4096, 1024, 128, 8) and d = 7168 (w7168).
#   Q (~8 min, H100): issue 15's table again on today's kernels: `decode.py` at every T of the
#      issue with the kernel-by-kernel path, static, dynamic and unfused megakernels.
#   D (~4 min, an H200 when one comes): issue 9: session 62's dh_bf16_da probe on an H200,
#      where the d >= 2048 split rule was never measured.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-T}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
case "$PART" in
T)
  timeout 560 python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu.py \
    -k "backward_cp_async or staged_output_slabs or dh_split or weight_grad_persistent or wgmma_lag_0_writes" \
    -rA > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "(PASSED|FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-160 | tail -40 ;;
S)
  timeout 540 python3 benchmarks/step.py --shapes ${SHAPES:-7b,7b-n1024} \
    --variants topk/cp_async,topk/cp_async/wg-128 --rounds 3 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "kernels (ms" $OUT/step.log | cut -c1-300
  grep "^|" $OUT/step.log | tail -6 ;;
G)
  timeout 540 python3 benchmarks/step.py --shapes gpt-oss-20b --gpt-oss \
    --variants topk/cp_async,topk/cp_async/lag1-dx --rounds 3 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "kernels (ms" $OUT/step.log | cut -c1-300
  grep "^|" $OUT/step.log | tail -4 ;;
C)
  timeout 540 python3 benchmarks/step.py --shapes ${SHAPES:-120b,w7168} \
    --variants topk/cp_async,topk/cp_async/split-dh-f32 --rounds 2 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | grep -v "^ *{" | cut -c1-400 | tail -12
  grep "^|" $OUT/step.log | tail -6 ;;
Q)
  timeout 540 python3 benchmarks/decode.py --tokens 1,8,64,128,512,1024,4096 --iters 20 \
    --variants kernels,static,dynamic,unfused --out $OUT > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"; tail -30 $OUT/decode.log | cut -c1-300 ;;
D)
  timeout 330 python3 benchmarks/history/session62/dh_bf16_da.py 30b,qwen3-30b-a3b,7b 2 \
    > $OUT/dh_bf16_da.log 2>&1
  echo "dh_bf16_da rc=$? at $(( $(date +%s) - T0 )) s"; tail -16 $OUT/dh_bf16_da.log | cut -c1-300 ;;
esac
