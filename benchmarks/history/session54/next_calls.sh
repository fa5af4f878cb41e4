# Session 54's GPU calls: `bash benchmarks/history/session54/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   G: issue 13's smooth-scale rows staged in SMEM by TMA (`scale_rows_smem`): the GPU tests
#      (every row against numpy, two configs), then quant_smem.py (1-4 slots paired against
#      the default, bitwise-checked on poisoned outputs) at d7168, 7B, 30B, d2048.
#   D: the staged default (2 rows from d = 4096 on): its GPU tests at d = 7168, issue 13's
#      table (`benchmarks/quant.py`) at d7168, 30B and 7B, then Nsight Compute on the
#      kernel at 7B and d = 7168 (staged and not): occupancy, stalls, L2 and issue rates;
#      then gpt-oss widths' forward lag sweep again (its up-proj gained 1.080x with lag 0 in
#      call 3, the only width where it won by much).
#   N (for session 55, ~6 min, H100): the GPU tests of the forward's new lag-0 defaults at
#      gpt-oss's widths (the up-proj's bitwise lag test there has not run; the 192-row and
#      cluster tests now run lag 0 as the default), then gpt-oss's whole training step with
#      the new default against `lag1-forward` (the forward before session 54), paired;
#      then `quant.py` at 7B, whose CONFIGS now time 2 staged rows with X per row (do the
#      two together free enough registers for a tenth CTA per SM?).
#   H (an H200, ~6 min, when no H100 comes): whether session 54's H100 choices hold there:
#      `quant.py` at d7168, 30B and 7B (its CONFIGS time 0, 1 and 2 staged scale rows) and
#      gpt-oss's forward lag sweep (the H200 keeps lag 1 until this runs).
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
D)
  timeout 100 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "wide_rows or smem" \
    > $OUT/gpu_wide.log 2>&1
  echo "gpu wide rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_wide.log
  timeout 150 python3 benchmarks/quant.py --shapes d7168,30b --token-rounding '' --out $OUT/quant \
    > $OUT/quant.log 2>&1
  echo "quant rc=$? at $(( $(date +%s) - T0 )) s"; grep "RATIOS\|WRONG\|failed" $OUT/quant.log | tail -8
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 ncu --section LaunchStats --section Occupancy \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --kernel-name regex:smoothquant \
    python3 benchmarks/history/session54/quant_profile.py 7b:default,d7168:default,d7168:smem0 \
    > $OUT/quant_ncu.log 2>&1
  echo "ncu rc=$? at $(( $(date +%s) - T0 )) s"
  grep "moe_smoothquant\|Registers Per\|Achieved Occupancy\|Block Limit\|Duration\|L2 Cache Throughput\|L1/TEX Hit\|L2 Hit\|Issued Warp Per\|No Eligible\|Stall\|Dynamic Shared\|Memory Throughput" $OUT/quant_ncu.log | cut -c1-150 | head -80
  timeout 120 python3 benchmarks/forward.py --shapes gpt-oss-20b --skew '' --up-sweep lag \
    --down-sweep lag --no-baselines --rounds 3 --out $OUT/fw > $OUT/fw.log 2>&1
  echo "forward gpt-oss lag rc=$? at $(( $(date +%s) - T0 )) s"
  grep "^  up \|^  down " $OUT/fw.log | cut -c1-120 ;;
N)
  timeout 300 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_up_proj_wgmma_lag_0_writes_the_default_bits or test_up_proj_192_row_split_m_equals_cooperative or (gpt_oss_widths and (cluster or grouped_gemm))" \
    > $OUT/gpu_lag_gpt_oss.log 2>&1
  echo "gpu lag rc=$? at $(( $(date +%s) - T0 )) s"; grep "PASSED\|FAILED\|passed\|failed" $OUT/gpu_lag_gpt_oss.log | tail -8
  timeout 240 python3 benchmarks/step.py --shapes gpt-oss-20b --gpt-oss \
    --variants topk/cp_async,topk/cp_async/lag1-forward --rounds 3 --out $OUT/step \
    > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step.log | tail -6
  timeout 100 python3 benchmarks/quant.py --shapes 7b --token-rounding '' --out $OUT/quant \
    > $OUT/quant.log 2>&1
  echo "quant 7b rc=$? at $(( $(date +%s) - T0 )) s"; grep "RATIOS\|WRONG\|failed" $OUT/quant.log | tail -4
  grep "scale_rows_smem=[012]\|x_per_row=True" $OUT/quant.log | sed 's/.*x_per_row=\([a-zA-Z]*\), scale_rows_smem=\([a-zA-Z0-9]*\)): /xpr=\1 smem=\2 /' | tail -12 ;;
H)
  timeout 300 python3 benchmarks/quant.py --shapes d7168,30b,7b --token-rounding '' --out $OUT/quant \
    > $OUT/quant.log 2>&1
  echo "quant rc=$? at $(( $(date +%s) - T0 )) s"; grep "RATIOS\|WRONG\|failed" $OUT/quant.log | tail -8
  grep "scale_rows_smem=[012])" $OUT/quant.log | sed 's/.*scale_rows_smem=\([012]\)): /smem\1 /' | tail -12
  timeout 150 python3 benchmarks/forward.py --shapes gpt-oss-20b --skew '' --up-sweep lag \
    --down-sweep lag --no-baselines --rounds 3 --out $OUT/fw > $OUT/fw.log 2>&1
  echo "forward gpt-oss lag rc=$? at $(( $(date +%s) - T0 )) s"
  grep "^  up \|^  down " $OUT/fw.log | sed 's/Config(.*wgmma_lag=\(.\)).*: /(lag=\1) /' | cut -c1-200 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
