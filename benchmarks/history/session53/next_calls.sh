# Session 53's GPU calls: `bash benchmarks/history/session53/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   Q: issue 13's quant kernel, what limits it (quant_diag.py), then session 52's part T
#      (the backward's lag-0 GPU tests at 3 widths).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-Q}
case "$PART" in
Q)
  timeout 170 python3 benchmarks/history/session53/quant_diag.py d7168,7b,30b,d2048 \
    > $OUT/quant_diag.log 2>&1
  echo "quant diag rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/quant_diag.log | tail -7
  timeout 380 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "test_wgmma_lag_0_writes_the_default_bits and not up_proj" > $OUT/gpu_lag.log 2>&1
  echo "gpu backward lag 0 rc=$? at $(( $(date +%s) - T0 )) s"; grep "PASSED\|FAILED\|passed\|failed" $OUT/gpu_lag.log | tail -6 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
