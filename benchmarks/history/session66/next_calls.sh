# GPU calls queued by session 66: `bash benchmarks/history/session66/next_calls.sh PART` from
# the repo root; logs under $OUT. Session 66 ran T2 (call 1) and MD (call 2); see its calls.md.
# In order:
#   X (~9.5 min, FIRST): the persistent weight gradients' GPU test where 192 divides d (7B,
#      d = 2880: session 64's default, never passed on a GPU; the test itself was mended in
#      session 66), the per-chunk schedule kernel's GPU tests and `decode.py` at T = 1, 8,
#      64 (`kernels` against `kernels_meta`; adopt `schedule_impl="auto"` up to the largest
#      T where it wins beyond the spread, else remove the kernel with a restoring patch)
#      and the aggregation's decode-size form (session 66: one token per CTA on small
#      grids, rows loaded in groups) against `kernels_agg4` (the previous form) with its GPU
#      test, then S at 7b (2 rounds). X2 / X3: the same cut to fit ~5 / ~2.5 min.
#   T3 (~6 min): the rest of session 64's GPU tests (the backward through cp.async, the
#      staged output slabs, the split dH).
#   S (~8 min, H100): 7b and 7b-n1024 steps, the weight gradients' 192-wide gathered chunks
#      against `wg-128`, and both aggregations' row groups (session 66) against `agg-1`, 3
#      paired rounds. Revert `_gathered_chunks` or `AggregateConfig.rows_in_flight` (to 1)
#      where the default is slower beyond the spread.
#   G (~5 min, H100): gpt-oss-20b step, dX~ lag 0 against `lag1-dx`, 3 paired rounds.
#   A1, A2 (~4-5 min each, H100): the audit list: up-proj `no_auto_barriers`,
#      `rebalance_registers=False`, the TMA loader's `row_unroll` 16 against 4 (A1:
#      `forward.py --up-sweep audit`), and the backward's `rebalance_registers=False` in dH
#      and both weight gradients (A2: `backward.py --sweep registers`), 3 paired rounds at
#      7b, gpt-oss-20b, 30b. Remove each option that is not faster beyond its spread.
#   C (~6 min, H100): the bf16-dA' split at (32768, 4096, 1024, 128, 8) and d = 7168.
#   Q (~8 min, H100): issue 15's whole table on today's kernels.
#   D (~4 min, an H200 when one comes): session 62's dh_bf16_da probe.
#   Kept for the record: T, T2, M, MT, MD (session 65/66 parts, run or superseded).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-X}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
case "$PART" in
T)
  timeout 560 python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu.py \
    -k "backward_cp_async or staged_output_slabs or dh_split or weight_grad_persistent or wgmma_lag_0_writes" \
    -rA > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "(PASSED|FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-160 | tail -40 ;;
T3)
  timeout 420 python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu.py \
    -k "backward_cp_async or staged_output_slabs or dh_split" -rA > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "(PASSED|FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-160 | tail -20 ;;
T2)
  # A short budget's T: session 64's two new defaults (the 192-wide persistent weight
  # gradients, dX~ at lag 0), then M's GPU tests of the new schedule kernel.
  timeout 300 python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu.py \
    -k "weight_grad_persistent or wgmma_lag_0_writes" -rA > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "(PASSED|FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-160 | tail -20
  timeout ${TESTS_S:-200} python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu_decode.py \
    -k "schedule or decode_meta_kernel" -rA > $OUT/gpu_decode_tests.log 2>&1
  echo "decode tests rc=$? at $(( $(date +%s) - T0 )) s"; grep -cE " PASSED" $OUT/gpu_decode_tests.log
  grep -E "(FAILED|ERROR)" $OUT/gpu_decode_tests.log | cut -c1-200 | tail -10 ;;
X|X2|X3)
  # The first call (X, ~9.5 min), or the same cut to fit what is left after a start (X2
  # ~5 min: no step, no qwen3 width; X3 ~2.5 min: 7B and two token counts only):
  # the weight gradients where 192 divides d (session 64's default, never passed on a GPU;
  # the test mended in session 66), the aggregation against its previous form, the
  # schedule kernel's and the aggregation's decode timing against their previous forms,
  # the schedule kernel's GPU tests, then the 7B step (S, 2 rounds).
  case "$PART" in
    X) WG="7b or qwen3 or w2880 or gpt_oss"; TESTS=200; TOKENS=1,8,64; DEC=110; SCHED=70 ;;
    X2) WG="7b or w2880 or gpt_oss"; TESTS=130; TOKENS=1,8,64; DEC=90; SCHED=70 ;;
    X3) WG="7b"; TESTS=75; TOKENS=8,1; DEC=75; SCHED=0 ;;
  esac
  timeout $TESTS python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu.py -rA \
    -k "(weight_grad_persistent and ($WG)) or aggregate_writes" > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "(PASSED|FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-200 | tail -10
  grep -E "^E  " $OUT/gpu_tests.log | head -5 | cut -c1-300
  timeout $DEC python3 benchmarks/decode.py --tokens $TOKENS --iters 30 \
    --variants kernels,kernels_meta,kernels_agg4 --out /tmp/dec > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "moe_forward_schedules|^\| [0-9]" $OUT/decode.log | cut -c1-200 | head -12
  grep -oE "(kernels[a-z_0-9]*: [0-9.]+ us GPU)|moe_aggregate_mosaic_gpu_kernel [0-9.]+" \
    $OUT/decode.log | head -18
  if [ $SCHED -gt 0 ]; then
    timeout $SCHED python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu_decode.py \
      -k "schedule" -rA > $OUT/gpu_sched_tests.log 2>&1
    echo "schedule tests rc=$? at $(( $(date +%s) - T0 )) s"
    grep -cE " PASSED" $OUT/gpu_sched_tests.log
    grep -E "(FAILED|ERROR)" $OUT/gpu_sched_tests.log | cut -c1-200 | tail -4
  fi
  [ "$PART" = X ] || exit 0
  SHAPES=7b; ROUNDS=2; S_S=$(( 570 - ($(date +%s) - T0) )) ;;&
S|X)
  timeout ${S_S:-540} python3 benchmarks/step.py --shapes ${SHAPES:-7b,7b-n1024} \
    --variants topk/cp_async,topk/cp_async/wg-128,topk/cp_async/agg-1 --rounds ${ROUNDS:-3} \
    --out $OUT > $OUT/step.log 2>&1
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
M|MT)
  timeout ${TESTS_S:-240} python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu_decode.py \
    -k "schedule or decode_meta_kernel" -rA > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; grep -cE " PASSED" $OUT/gpu_tests.log
  grep -E "(FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-200 | tail -10
  [ "$PART" = MT ] && exit 0 ;&
MD)
  timeout 300 python3 benchmarks/decode.py --tokens 1,8,64,128 --iters 30 \
    --variants kernels,kernels_meta,static,static_meta --out $OUT > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"; tail -24 $OUT/decode.log | cut -c1-300 ;;
A1)
  timeout 540 python3 benchmarks/forward.py --shapes 7b,gpt-oss-20b,30b --skew '' --up-sweep audit \
    --down-sweep none --no-baselines --rounds 3 --out $OUT/fw > $OUT/fw.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep -iE "up |speed|paired|x\)" $OUT/fw.log | cut -c1-300 | tail -20 ;;
A2)
  timeout 540 python3 benchmarks/backward.py --shapes 7b,gpt-oss-20b,30b --sweep registers \
    --rounds 3 --out $OUT/bw > $OUT/bw.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^ *{" $OUT/bw.log | cut -c1-300 | tail -24 ;;
Q)
  timeout 540 python3 benchmarks/decode.py --tokens 1,8,64,128,512,1024,4096 --iters 20 \
    --variants kernels,static,dynamic,unfused --out $OUT > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"; tail -30 $OUT/decode.log | cut -c1-300 ;;
D)
  timeout 330 python3 benchmarks/history/session62/dh_bf16_da.py 30b,qwen3-30b-a3b,7b 2 \
    > $OUT/dh_bf16_da.log 2>&1
  echo "dh_bf16_da rc=$? at $(( $(date +%s) - T0 )) s"; tail -16 $OUT/dh_bf16_da.log | cut -c1-300 ;;
esac
