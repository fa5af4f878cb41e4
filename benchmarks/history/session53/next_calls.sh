# Session 53's GPU calls: `bash benchmarks/history/session53/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   Q: issue 13's quant kernel, what limits it (quant_diag.py: one-expert, no-smooth and
#      x_per_row beside the default, paired; ncu's registers and occupancy of the default
#      and x_per_row), and x_per_row's GPU tests (~400 s).
#   T: session 52's part T (the backward's lag-0 GPU tests at 3 widths).
#   W: the SmoothQuant expert walk (quant_walk.py) and its GPU test (~300 s). Ran (part w,
#      cut); the walk was then removed (history/session53/expert_walk.patch), so W and w
#      no longer run.
#   P (for session 54, ~5 min): issue 13's table on the H100 with the x_per_row default,
#      every CSR config of `benchmarks/quant.py` (scale_rows_ahead=1 among them), int8 and
#      e4m3, at 7B, d7168, 30B and d2048 (top-K plans; the misses first).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-Q}
case "$PART" in
Q)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 ncu --metrics \
    launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_sector_hit_rate.pct \
    --kernel-name regex:smoothquant python3 benchmarks/history/session53/quant_diag.py \
    d7168,7b,30b --once > $OUT/quant_ncu.log 2>&1
  echo "ncu rc=$? at $(( $(date +%s) - T0 )) s"
  grep "moe_smoothquant\|registers_per_thread\|occupancy_limit\|warps_active\|duration\|lts__\|l1tex" $OUT/quant_ncu.log | tail -40
  timeout 230 python3 benchmarks/history/session53/quant_diag.py d7168,7b,d7168:e4m3,7b:e4m3,30b \
    > $OUT/quant_diag.log 2>&1
  echo "quant diag rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|bitwise" $OUT/quant_diag.log | tail -12
  timeout 60 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "x_per_row or default" \
    > $OUT/gpu_quant.log 2>&1
  echo "gpu quant rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_quant.log ;;
T)
  timeout 400 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "test_wgmma_lag_0_writes_the_default_bits and not up_proj" > $OUT/gpu_lag.log 2>&1
  echo "gpu backward lag 0 rc=$? at $(( $(date +%s) - T0 )) s"; grep "PASSED\|FAILED\|passed\|failed" $OUT/gpu_lag.log | tail -6 ;;
W)
  timeout 240 python3 benchmarks/history/session53/quant_walk.py d7168,7b,30b,d7168:e4m3 \
    > $OUT/quant_walk.log 2>&1
  echo "quant walk rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|copy" $OUT/quant_walk.log | tail -24
  timeout 60 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "expert_walk" \
    > $OUT/gpu_walk.log 2>&1
  echo "gpu walk rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_walk.log ;;
w)  # W cut to fit session 53's last 287 s of device time
  timeout 170 python3 benchmarks/history/session53/quant_walk.py d7168,7b \
    > $OUT/quant_walk.log 2>&1
  echo "quant walk rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|copy" $OUT/quant_walk.log | tail -12 ;;
P)
  timeout 540 python3 benchmarks/quant.py --shapes 7b,d7168,30b,d2048 --token-rounding '' --out $OUT/quant \
    > $OUT/quant.log 2>&1
  echo "quant rc=$? at $(( $(date +%s) - T0 )) s"; grep "RATIOS\|WRONG\|failed" $OUT/quant.log | tail -14 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
