# Session 61's GPU calls: `bash benchmarks/history/session61/next_calls.sh PART` from the
# repo root; logs under $OUT.
#   A (~6 min, H100): issue 9: the split dH's GPU test (session 60's row-count clamp and the
#      test's `_dh_problem` refactor had not run on a GPU); issue 16: the down-proj's
#      configs where its K loop is long (n = 1024 and 2048), where the default 128 x 128
#      ping-pong was never measured against the split-M 128 x 256 items (chosen at n <= 512).
#      `SHAPES=... bash ... A` for other shapes (then the tests run again too).
#   B (~4 min, H100): issue 16: the training step with the down-proj on split-M 128 x 256
#      items against the 128-row ping-pong, paired, at `SHAPES` (default 30b-n1024,w7168).
#      Call 2 ran it as `split-m-down` against the default of the time; since the rule
#      changed (n >= 768) the flag is `pingpong-down`, the old default.
#   C (~5 min, H100): issue 16: the new down-proj rule (n >= 768) in the end-to-end GPU tests
#      at n = 768 and 1024 (forward and gradients against xla, bitwise repeat), then part B
#      at the Qwen3-30B-A3B widths and (32768, 4096, 2048, 64, 4).
#   D (~3 min, H100): issue 15: the decode megakernel's phases at T = 1 on the H100 (up
#      tasks alone, up + down, down alone, the aggregation; the bare W1 stream on the up
#      tasks' 96 CTAs and on twice as many).
#   E (~4 min, H100): issue 15: `DecodeConfig.early_down_l2` (each CTA's next down tasks'
#      W2 tiles asked for at the start with `prefetch.global.L2::evict_last`) against the
#      default at T = 1 and 2 (whole jitted call, error against xla; `static_s5` is the
#      default again, timed last), then its GPU tests (bitwise the default).
#   F (~6 min, H100): issue 13: the fp8 down-proj's split-M 256-column items against its
#      ping-pong at wide experts (30b-n1024, Qwen3 widths; 30B as the control), bitwise
#      against the default, paired.
#   G (~9 min, H100): issues 9 and 16: every backward kernel's block-size sweep (`--sweep
#      full`) at wide experts (`SHAPES`, default 30b-n1024; also w7168), where the weight
#      gradients ran at 420-521 TFLOP/s in the steps: are their 7B-chosen tiles wrong there,
#      as the down-proj's were?
# For session 62: E first (the only unmeasured build), then G and F.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-A}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
case "$PART" in
A)
  timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "dh_split" \
    > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_tests.log
  timeout 330 python3 benchmarks/forward.py --shapes ${SHAPES:-30b-n1024,w7168} --skew '' \
    --up-sweep none --down-sweep default --no-baselines --rounds 2 --out $OUT > $OUT/fwd.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "^  down|down .*us|paired|FAILED" $OUT/fwd.log | cut -c1-260 | tail -30 ;;
B)
  timeout 500 python3 benchmarks/step.py --shapes ${SHAPES:-30b-n1024,w7168} \
    --variants topk/cp_async,topk/cp_async/pingpong-down --rounds 2 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | cut -c1-700 | tail -12
  grep "^|" $OUT/step.log | tail -6 ;;
C)
  timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "at_d_2048 or wide_experts_at_d_1536" > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_tests.log
  SHAPES=${SHAPES:-qwen3-30b-a3b,120b-n2048} bash $0 B ;;
D)
  timeout 300 python3 benchmarks/history/session61/decode_phases.py --tokens 1 --rounds 3 \
    --out $OUT > $OUT/phases.log 2>&1
  echo "phases rc=$? at $(( $(date +%s) - T0 )) s"; tail -8 $OUT/phases.log | cut -c1-900 ;;
E)
  timeout 200 python3 benchmarks/decode.py --tokens 1,2 --iters 30 \
    --variants static,static_l2first,static_l2first2,static_s5 --out $OUT > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "^== T|  static" $OUT/decode.log | cut -c1-220
  timeout 120 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py -k "early_down_l2" \
    > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_tests.log ;;
G)
  timeout 550 python3 benchmarks/backward.py --shapes ${SHAPES:-30b-n1024} --sweep full \
    --rounds 2 --out $OUT > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "^  (dH|dW2|dW1|dX)" $OUT/backward.log | cut -c1-300 | tail -30 ;;
F)
  timeout 500 python3 benchmarks/quant.py --fp8 --shapes 30b-n1024,qwen3,30b --down-sweep \
    --rounds 2 --token-rounding '' --out $OUT > $OUT/fp8.log 2>&1
  echo "fp8 rc=$? at $(( $(date +%s) - T0 )) s"; tail -30 $OUT/fp8.log | cut -c1-250 ;;
esac
