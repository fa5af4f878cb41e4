# Session 54's GPU calls: `bash benchmarks/history/session54/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   G: issue 13's smooth-scale rows staged in SMEM by TMA (`scale_rows_smem`): the GPU tests
#      (every row against numpy, two configs), then quant_smem.py (1-4 slots paired against
#      the default, bitwise-checked on poisoned outputs) at d7168, 7B, 30B, d2048.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-G}
case "$PART" in
G)
  timeout 120 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "smem" \
    > $OUT/gpu_smem.log 2>&1
  echo "gpu smem rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_smem.log
  timeout 330 python3 benchmarks/history/session54/quant_smem.py d7168,7b,30b,d7168:e4m3,7b:e4m3,d2048 \
    > $OUT/quant_smem.log 2>&1
  echo "quant smem rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|bitwise\|failed" $OUT/quant_smem.log | tail -24 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
