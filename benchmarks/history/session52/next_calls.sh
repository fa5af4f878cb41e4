# Session 52's GPU plan (carried over from session 51): `bash benchmarks/history/session52/next_calls.sh PART` from the repo
# root; logs under $OUT. For the next GPU session, in this order:
#   T then L (an H100, ~8 + 6 min): two ways to keep more stages loading (session 51
#     found 3 stages instead of 4 cost the 30B up-proj 12%): `wgmma_lag=0` (each slot released as soon as
#     its own K step's wgmmas are done) and the up-proj's 32-wide K steps (`block_k=32`,
#     64-byte swizzle, 8 stages of 24 KB). T: their GPU bitwise tests (interpret mode
#     runs wgmma synchronously and has no swizzle, so only these can see a slot released
#     too early or a wrong 64-byte XOR; run L only for what passed). L: the forward sweeps
#     (up-proj: default, 32-wide, 32-wide with lag 0, lag 0; down-proj: lag 0) at 30B,
#     Qwen3, gpt-oss and 7B widths.
#   M (an H100, ~6 min): the backward sweep (dH, dW2, dW1, dX~ with lag 0) at 30B, 7B and
#     gpt-oss widths.
#   S (only where L or M found a win): the 30B and 7B steps with `k32-up`, `lag0-up` and
#     `lag0-rest` against the default, paired (drop the variants that did not win). Adopt
#     per kernel and width only by measurement, then add `for_shape` tests.
#   R (an H100, ~2 min): the 192-row grouped GEMM GPU test at 30B widths (it failed in
#     session 51 on SMEM; `three_consumer_gemm` now stages two slabs at a time there).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-T}
short() {  # one line per timed config: kernel, lag, stages, us, ratio
  grep "^  up \|^  down \|  dH \|  dW\|  dX~ " "$1" \
    | sed 's/Config(\(block_m=[0-9]*\).*block_k=\([0-9]*\), num_stages=\([0-9]*\).*wgmma_lag=\(.\)).*: /(\1 bk=\2 st=\3 lag=\4) /' \
    | cut -c1-200
}
case "$PART" in
A)  # session 52: device time was short after failed starts, so the up-proj first (~590 s)
  timeout 170 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "(up_proj_wgmma_lag_0 or 32_wide_k_steps) and 30b_widths" > $OUT/gpu_up30b.log 2>&1
  echo "gpu up 30b rc=$? at $(( $(date +%s) - T0 )) s"; grep "PASSED\|FAILED\|passed\|failed" $OUT/gpu_up30b.log | tail -6
  timeout 240 python3 benchmarks/forward.py --shapes 30b,qwen3-30b-a3b,7b \
    --skew '' --up-sweep pipeline --down-sweep none --no-baselines --rounds 3 --out $OUT/fw \
    > $OUT/fw.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep "^==\|errors" $OUT/fw.log | cut -c1-100
  short $OUT/fw.log
  timeout $(( 570 - $(date +%s) + T0 )) python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "(up_proj_wgmma_lag_0 or 32_wide_k_steps) and not 30b_widths" > $OUT/gpu_up_rest.log 2>&1
  echo "gpu up rest rc=$? at $(( $(date +%s) - T0 )) s"; grep "PASSED\|FAILED\|passed\|failed" $OUT/gpu_up_rest.log | tail -6 ;;
B)  # session 52: the backward's lag 0 at 30B (its GPU test, then the sweep), 7B if time is left
  timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "test_wgmma_lag_0_writes_the_default_bits and 30b_widths" > $OUT/gpu_bw_lag30b.log 2>&1
  echo "gpu backward lag 0 (30B) rc=$? at $(( $(date +%s) - T0 )) s"; grep "PASSED\|FAILED\|passed\|failed" $OUT/gpu_bw_lag30b.log | tail -4
  timeout $(( 570 - $(date +%s) + T0 )) python3 benchmarks/backward.py --shapes 30b,7b --sweep lag \
    --rounds 3 --out $OUT/bw > $OUT/bw.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; short $OUT/bw.log; grep "^|" $OUT/bw.log ;;
T)
  timeout 560 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "wgmma_lag_0 or 32_wide_k_steps" > $OUT/gpu_lag.log 2>&1
  echo "gpu lag/k32 rc=$? at $(( $(date +%s) - T0 )) s"; grep "PASSED\|FAILED\|passed\|failed" $OUT/gpu_lag.log | tail -12 ;;
L)
    timeout 300 python3 benchmarks/forward.py --shapes 30b,qwen3-30b-a3b,gpt-oss-20b,7b \
      --skew '' --up-sweep k32 --down-sweep lag --no-baselines --rounds 3 --out $OUT/fw \
      > $OUT/fw.log 2>&1
    echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep "^==" $OUT/fw.log | cut -c1-60
    short $OUT/fw.log
    timeout 200 python3 benchmarks/forward.py --shapes 30b,qwen3-30b-a3b,gpt-oss-20b,7b \
      --skew '' --up-sweep lag --down-sweep none --no-baselines --rounds 3 --out $OUT/fwlag \
      > $OUT/fwlag.log 2>&1
    echo "forward lag rc=$? at $(( $(date +%s) - T0 )) s"; short $OUT/fwlag.log ;;
M)
  timeout 400 python3 benchmarks/backward.py --shapes 30b,7b,gpt-oss-20b --sweep lag \
    --rounds 3 --out $OUT/bw > $OUT/bw.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; short $OUT/bw.log; grep "^|" $OUT/bw.log ;;
S)
  timeout 560 python3 benchmarks/step.py --shapes 30b,7b \
    --variants topk/cp_async,topk/cp_async/k32-up,topk/cp_async/lag0-up,topk/cp_async/lag0-rest --rounds 3 \
    --out $OUT/step > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step.log | tail -8 ;;
R)
  timeout 200 python3 -m pytest -p no:xdist -q -x -m gpu tests/test_gpu.py \
    -k "192_row_split_m_writes" > $OUT/gpu_gemm192.log 2>&1
  echo "gpu gemm 192 rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_gemm192.log ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
