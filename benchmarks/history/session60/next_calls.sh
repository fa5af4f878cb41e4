# Session 60's GPU calls: `bash benchmarks/history/session60/next_calls.sh PART` from the
# repo root; logs under $OUT.
#   T (~5 min, H100): issue 9: the split dH's GPU tests (bitwise the fused kernel at 30B,
#      7B and Qwen3 widths under four GEMM configs; the whole backward with cp.async at
#      d = 4096, where it is the default), then `backward.py --shapes 30b` (every backward
#      kernel, the split dH beside the fused one, the whole backward against the bound).
#   S (~5 min, H100): issue 9: the 30B training step with the split dH (the default)
#      against the fused dH (`fused-dh`), paired over 2 rounds, with the kernel breakdown.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-T}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
case "$PART" in
T)
  timeout 300 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "dh_split or backward_cp_async or empty_experts_on_gpu" > $OUT/gpu_tests.log 2>&1
  echo "gpu tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 $OUT/gpu_tests.log
  timeout 250 python3 benchmarks/backward.py --shapes 30b --out $OUT > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "dH split|whole backward|^  dH |^  dW|^  dX" $OUT/backward.log | cut -c1-300 | tail -14
  grep '"bwd_default_us"' $OUT/backward.log | tr ',' '\n' | grep -E "bwd_default_us|dh_us|dh_split_us|dw2_us|dw1_us|dx_us|bmm_bound_us|correct|err_dh_split" ;;
S)
  timeout 450 python3 benchmarks/step.py --shapes 30b \
    --variants topk/cp_async,topk/cp_async/fused-dh --rounds 2 --out $OUT > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | cut -c1-600 | tail -10
  grep "^|" $OUT/step.log | tail -6 ;;
esac
# For session 61:
#   N (~1.5 min, H100): issue 9: Nsight Compute of the split dH's GEMM (`moe_dh_gemm`) at
#      30B: tensor-busy, L2, DRAM and source counters, to set it beside the up-proj's (81%
#      busy in session 59) before tuning it.
#   G (~3 min, H100): issue 9: the split dH at the widths the rule has not measured alone:
#      d = 2880, n = 1408 (w2880: 128-column GEMM items only; between Qwen3's d = 2048,
#      0.979x, and 30B's 4096, 1.150x) and d = 7168 (w7168), 2 paired rounds, bitwise checks.
case "$PART" in
N)
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  timeout 150 ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section SourceCounters --kernel-name regex:moe_dh_gemm --launch-skip 1 --launch-count 1 \
    -o /tmp/dhgemm python3 benchmarks/timeline.py --run-only --out /tmp/t --shapes 30b \
    --kernels dhsplit > $OUT/ncu_dhgemm.log 2>&1
  echo "ncu rc=$? at $(( $(date +%s) - T0 )) s"
  ncu -i /tmp/dhgemm.ncu-rep --page details > $OUT/dhgemm_details.txt 2>&1
  ncu -i /tmp/dhgemm.ncu-rep --page source --csv --print-source sass > /tmp/dhgemm.csv 2>/dev/null
  gzip -c /tmp/dhgemm.csv > $OUT/dhgemm_sass.csv.gz
  python3 benchmarks/ncu_source.py /tmp/dhgemm.csv --listing 3000 > $OUT/dhgemm_stalls.txt 2>&1
  grep -E "Duration|Compute \(SM\)|L2 Cache Throughput|DRAM Throughput" $OUT/dhgemm_details.txt
  sed -n 3,14p $OUT/dhgemm_stalls.txt ;;
G)
  timeout 400 python3 benchmarks/history/session60/dh_split.py w2880,w7168 2 > $OUT/dh_split_g.log 2>&1
  echo "dh split rc=$? at $(( $(date +%s) - T0 )) s"
  grep -v "^|" $OUT/dh_split_g.log | grep -v -i warn | tail -24; grep "^|" $OUT/dh_split_g.log ;;
esac
