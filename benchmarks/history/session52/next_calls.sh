# The GPU plan for session 53 on: `bash benchmarks/history/session52/next_calls.sh PART` from
# the repo root; logs under $OUT. Session 52 ran part A (the up-proj's lag-0 and 32-wide K
# GPU tests and sweeps; its `--up-sweep pipeline` and the 32-wide K steps are removed since,
# see commit 1094dd5) and the 30B half of B. In this order:
#   T (an H100, ~8 min): `test_wgmma_lag_0_writes_the_default_bits` (dH, both weight
#     gradients, the down-proj and dX~ with lag 0, at 30B, 7B and gpt-oss widths: only it
#     can see a slot released before its wgmmas finished), then R's test.
#   M (an H100, ~6 min): the backward's lag sweep at 30B (again: dW1 measured 1.045x there
#     inside a 6.6% spread), 7B and gpt-oss widths. Adopt lag 0 for a kernel only where T
#     passed and it wins by more than the spreads at two widths.
#   L (an H100, ~6 min): the forward's lag sweeps at 7B and gpt-oss widths (session 52's were
#     cut at 7B), up-proj and down-proj, then 30B again: its default moved 16% between
#     session 52's rounds, and the sweeps now log each config's SM clock, power and
#     slowdown reasons (`benchmarks/gpu_clocks.py`), which say whether a power cap did it.
#   R (in T): the 192-row grouped GEMM GPU test at 30B widths (it failed in session 51 on
#     SMEM; `grouped_gemm.smem_bytes` now refuses over-budget configs and
#     `three_consumer_gemm` stages two slabs at a time there).
#   S (only where M or L found a win): the 30B and 7B steps with `lag0-up` / `lag0-rest`.
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
T)
  timeout 420 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "test_wgmma_lag_0_writes_the_default_bits and not up_proj" > $OUT/gpu_lag.log 2>&1
  echo "gpu backward lag 0 rc=$? at $(( $(date +%s) - T0 )) s"; grep "PASSED\|FAILED\|passed\|failed" $OUT/gpu_lag.log | tail -6
  timeout 150 python3 -m pytest -p no:xdist -q -x -m gpu tests/test_gpu.py \
    -k "192_row_split_m_writes and 30b" > $OUT/gpu_gemm192.log 2>&1
  echo "gpu gemm 192 rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_gemm192.log ;;
M)
  timeout 540 python3 benchmarks/backward.py --shapes 30b,7b,gpt-oss-20b --sweep lag \
    --rounds 3 --out $OUT/bw > $OUT/bw.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; short $OUT/bw.log; grep "^|" $OUT/bw.log ;;
L)
  timeout 420 python3 benchmarks/forward.py --shapes 7b,gpt-oss-20b,30b \
    --skew '' --up-sweep lag --down-sweep lag --no-baselines --rounds 3 --out $OUT/fw \
    > $OUT/fw.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; short $OUT/fw.log ;;
S)
  timeout 560 python3 benchmarks/step.py --shapes 30b,7b \
    --variants topk/cp_async,topk/cp_async/lag0-up,topk/cp_async/lag0-rest --rounds 3 \
    --out $OUT/step > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step.log | tail -8 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
