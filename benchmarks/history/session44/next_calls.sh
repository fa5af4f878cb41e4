# Session 44's plan for the next GPU session: `bash benchmarks/history/session44/next_calls.sh PART`
# from the repo root; each part < 10 min, logs under $OUT. A fresh machine compiles every kernel
# (~40 s per GPU test), so the test parts are narrow. In this order:
#   on an H100: S (the up-proj at 30B, each card's default, and the whole step on session 44's
#   defaults), then T (decode T >= 128 and the 30B backward ratio), then Q (issue 13);
#   on any card: G (the GPU tests session 44 changed or did not reach), then R (the rest of
#   the decode GPU tests).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-S}
if [ "$PART" = auto ]; then  # a call that may land on either card: S on an H100, G on an H200
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then PART=S; else PART=G; fi
  echo "auto -> part $PART"
fi
case "$PART" in
S)
  # Issue 16 / 9 on the H100. Session 44's up-proj sweep timed the split-M kernel with TMA
  # rows only; the H200's default loads them by cp.async (session 43's 30B step breakdown:
  # 3.73 against 4.29-4.46 ms). Adopt it on the H100 at 30B if it wins by > 2% with spreads
  # under 1%. Then the whole step on session 44's defaults (persistent weight gradients on
  # every card) with and without the split-M up-proj, paired (session 43: 3.607 / 21.361 ms).
  timeout 150 python3 benchmarks/forward.py --shapes 30b --skew '' --up-sweep cards \
    --down-sweep none --no-baselines --rounds 3 --out $OUT/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep "^  up \|^==" $OUT/forward.log | cut -c1-330
  timeout 400 python3 benchmarks/step.py --out $OUT/st --shapes 7b,30b --rounds 3 \
    --variants topk/cp_async,topk/cp_async/split-m-up > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^==\|^|" $OUT/step.log | tail -10 ;;
T)
  # Issue 15's T = 1024 target on the H100 (>= 1.2x faster than the kernel path), which
  # session 44's table did not reach; then the 30B backward against its bound.
  timeout 300 python3 benchmarks/decode.py --out $OUT/dec --tokens 128,512,1024,4096 \
    --iters 20 --variants kernels,static,dynamic,unfused > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"; grep "^| " $OUT/decode.log | tail -8
  timeout 200 python3 benchmarks/backward.py --shapes 30b --sweep none --rounds 3 --out $OUT/bw \
    > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|bwd_vs_bmm" $OUT/backward.log | cut -c1-200 | tail -6 ;;
G)
  # Session 44 made the persistent weight gradients every card's default and rewrote their
  # GPU test around `for_shape`; dH's bitwise test (after session 42's removal) has not run.
  timeout 560 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "weight_grad_persistent_equals_one_cta_per_item or dh_configs_write_the_same_bits" \
    > $OUT/gpu.log 2>&1
  echo "gpu rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 $OUT/gpu.log ;;
R)
  # The decode GPU tests session 44 did not reach (it ran every `test_matches_xla` case).
  timeout 560 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py \
    tests/test_kernels_decode.py -k "not test_matches_xla" > $OUT/gpu_decode.log 2>&1
  echo "gpu decode rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 $OUT/gpu_decode.log ;;
Q)
  # Issue 13 on the H100 (every fp8 / quant figure since session 7 is an H200's).
  bash benchmarks/history/session43/next_calls.sh Q ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
