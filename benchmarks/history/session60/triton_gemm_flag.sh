# Issue 9: does XLA fold x's gradient sum (`wrapped_add`, 0.076 ms of the 7B step) into the
# router's dx GEMM when dots go to cuBLAS directly (--xla_gpu_enable_triton_gemm=false), and
# does the step gain? Three processes (the flag is read at backend start): default, flag,
# default; then the flag's optimized HLO around the sum. Logs under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
i=0
for flags in "" "--xla_gpu_enable_triton_gemm=false" ""; do
  i=$((i + 1)); mkdir -p $OUT/run$i
  XLA_FLAGS="$flags" timeout 150 python3 benchmarks/step.py --shapes 7b --variants topk/cp_async \
    --out $OUT/run$i > $OUT/run$i/step.log 2>&1
  echo "run $i flags='$flags' rc=$? at $(( $(date +%s) - T0 )) s"
  grep -o '"gpu_ms": [0-9.]*' $OUT/run$i/step.log
  grep "kernels (ms" $OUT/run$i/step.log | cut -c1-700
done
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 100 python3 \
  benchmarks/history/session60/hlo_add.py 7b $OUT > $OUT/hlo_flag.log 2>&1
echo "hlo rc=$? at $(( $(date +%s) - T0 )) s"; cut -c1-600 $OUT/hlo_flag.log | tail -8
