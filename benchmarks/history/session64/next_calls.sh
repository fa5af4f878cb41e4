# GPU calls of session 64: `bash benchmarks/history/session64/next_calls.sh PART` from the
# repo root; logs under $OUT.
#   A (~7 min, H100): issue 9: the new default (dH split with dA' in bf16 from d >= 2048)
#      through its GPU tests, then the step against the previous defaults (`split-dh-f32`:
#      30B's from session 60 to 62; `fused-dh`: Qwen3 widths'), paired over 3 rounds.
#      (Ran as call 8; its tests then as calls 9-10.) Parts for the next session:
#   B (~7 min, H100): issue 9: the persistent weight gradients' other tiles (`backward.py
#      --sweep persistent`, built in session 63: 192/256-wide gathered chunks with 3 stages,
#      64-wide contiguous tiles with twice the consumers, every output chunk buffered, one
#      stage fewer; all lower for cuda) at 7B and 30B, 2 rounds. Adopt one only where it
#      beats the default by more than the rounds' spread, then time the step paired.
#   C (~6 min, H100): issue 9: the bf16-dA' split at the other d >= 4096 shapes, paired
#      against `split-dh-f32`: (32768, 4096, 1024, 128, 8) and d = 7168 (w7168).
#   D (~4 min, an H200 when one comes): issue 9: the same probe as session 62's part H on an
#      H200, where the d >= 2048 rule was never measured (its faster HBM should help the
#      split's row pass).
#   E (~4 min, H100): issue 16: the grouped GEMM's clusters (`GroupedMatmulConfig.cluster_m=2`,
#      opt-in) on today's split-M down-proj at n >= 768 (session 50 measured them against the
#      old ping-pong: 1.035x at the Qwen3 widths, 0.84-0.92x elsewhere). Both lower for cuda
#      (checked in session 63). Where they are still not faster, remove them (the up-proj's
#      clusters, its default from d = 2880 to 4096, stay).
#   F (~8 min, H100): issue 9: the split dH's GEMM with more of its output staged
#      (`history/session63/dh_gemm_out.py 30b,qwen3-30b-a3b 2`: a ring of two slabs, two
#      slabs a round, the whole tile or a 4-slab ring with 3 stages; prediction in its
#      docstring). Adopt in `dh_split_gemm_config` where one wins beyond the spread.
#   G (~7 min, H100): issue 16: the opt-ins session 63's audit could not settle without a
#      run: dH and the weight gradients at `wgmma_lag=0` (dH 1.033x once at gpt-oss; dW1
#      1.045x then 0.987x at 30B), paired over 3 rounds at gpt-oss-20b and 7B
#      (`backward.py --sweep lag`). Remove each lag-0 option that does not win beyond spread.
#   H (~3 min, H100): issue 15: `DecodeConfig.rebalance_registers=True` (session 12: 57.7
#      against 60.2 us at T = 1 on the old 4-stage default) against today's default, T = 1, 2.
#      Remove it unless it wins.
#   A2 (~9 min, H100, FIRST): the GPU tests of the kernels session 63 changed on the CPU
#      after its last GPU call: the grouped GEMM (index arithmetic left by the removed fp8
#      fused requantization, commit "Grouped GEMM: drop the fused requantization's index
#      vestiges"), the fp8/int8 paths through it, the weight gradients (mbarrier-only
#      stages, expert-major only): 38 tests, give them the whole call (run with -rA: a
#      cut run still says which passed). A3 (~4 min): then the 7B and 30B steps, to
#      compare with calls 4 and 8 (down-proj 0.338 / 1.87 ms, dX~ 0.543 / 3.43 ms).
# A2 and A3 first, then B (it can move the 7B step, whose dW1 is its largest kernel), then F, C,
# E, G, H, then D.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-A}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
case "$PART" in
A2)
  timeout 560 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant_fp8.py tests/test_quant_int8.py \
    tests/test_gpu.py -k "fp8 or int8 or grouped_gemm or slabs or weight_grad or backward_cp_async or dh_split" \
    -rA > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -45 | cut -c1-160 ;;
A3)
  timeout 400 python3 benchmarks/step.py --shapes 7b,30b --variants topk/cp_async --rounds 1 \
    --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "kernels (ms" $OUT/step.log | cut -c1-400; grep "^|" $OUT/step.log | tail -4 ;;
A)
  timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "dh_split or backward_cp_async or empty_experts_on_gpu" > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_tests.log
  timeout 380 python3 benchmarks/step.py --shapes ${SHAPES:-qwen3-30b-a3b,30b} \
    --variants topk/cp_async,topk/cp_async/split-dh-f32,topk/cp_async/fused-dh --rounds 3 \
    --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | grep -v "^ *{" | cut -c1-400 | tail -14
  grep "^|" $OUT/step.log | tail -8 ;;
B)
  timeout 540 python3 benchmarks/backward.py --shapes ${SHAPES:-7b,30b} --sweep persistent \
    --rounds 2 --out $OUT > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^\||speed|paired" $OUT/backward.log | cut -c1-300 | tail -30 ;;
C)
  timeout 540 python3 benchmarks/step.py --shapes ${SHAPES:-120b,w7168} \
    --variants topk/cp_async,topk/cp_async/split-dh-f32 --rounds 2 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | grep -v "^ *{" | cut -c1-400 | tail -12
  grep "^|" $OUT/step.log | tail -6 ;;
E)
  timeout 540 python3 benchmarks/forward.py --shapes ${SHAPES:-qwen3-30b-a3b,30b-n1024} \
    --up-sweep none --down-sweep cluster --no-baselines --rounds 2 --out $OUT > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^\||paired" $OUT/forward.log | cut -c1-300 | tail -20 ;;
F)
  timeout 540 python3 benchmarks/history/session63/dh_gemm_out.py ${SHAPES:-30b,qwen3-30b-a3b} 2 \
    > $OUT/dh_gemm_out.log 2>&1
  echo "dh_gemm_out rc=$? at $(( $(date +%s) - T0 )) s"; tail -24 $OUT/dh_gemm_out.log | cut -c1-300 ;;
G)
  timeout 540 python3 benchmarks/backward.py --shapes ${SHAPES:-gpt-oss-20b,7b} --sweep lag \
    --rounds 3 --out $OUT > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^\||speed|paired" $OUT/backward.log | cut -c1-300 | tail -30 ;;
H)
  timeout 400 python3 benchmarks/decode.py --tokens 1,2 --iters 30 \
    --variants static,static_regs,static_s5 --out $OUT > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"; tail -20 $OUT/decode.log | cut -c1-300 ;;
D)
  timeout 330 python3 benchmarks/history/session62/dh_bf16_da.py 30b,qwen3-30b-a3b,7b 2 \
    > $OUT/dh_bf16_da.log 2>&1
  echo "dh_bf16_da rc=$? at $(( $(date +%s) - T0 )) s"; tail -16 $OUT/dh_bf16_da.log | cut -c1-300 ;;
esac
