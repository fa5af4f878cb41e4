# Session 56's GPU calls: `bash benchmarks/history/session56/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   C (~8 min, H100 or H200): session 55's part C with session 56's dH variants: the
#      up-proj's lag-0 GPU test at gpt-oss widths, then `dh_ablation.py` at 7B and 30B over 2
#      rounds: the default, no epilogue, no H load, the H prefetch 8 steps ahead (bitwise
#      checked on poisoned outputs: it stands in for the prefetch's GPU test) and four
#      consumers of 64 columns (5 and 4 stages; dH and A' bitwise, dS against XLA).
#   E, G, A, N, F, D: session 55's parts (`benchmarks/history/session55/next_calls.sh`).
#   R (~5 min, H100): issue 15 at T = 1 and 2 after session 56's routing change (the small
#      batch's plan without the scatter, its zeros and the offsets' iota): the routing GPU
#      test (every plan field and the gradient bitwise the dense reference), then
#      session 55's part D (split K of the megakernel's up tasks, two opposite orders),
#      whose kernel lists show the new routing chain.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-R}
case "$PART" in
C)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
  timeout 140 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_up_proj_wgmma_lag_0_writes_the_default_bits and gpt_oss" > $OUT/gpu_lag_gpt_oss.log 2>&1
  echo "gpu up-proj lag gpt-oss rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_lag_gpt_oss.log
  timeout 330 python3 benchmarks/history/session55/dh_ablation.py 7b,30b 2 \
    default,no_epi,no_hload,pf8,c4,c4s4 > $OUT/dh_ablation.log 2>&1
  echo "dh ablation rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_ablation.log | tail -22
  grep "^|" $OUT/dh_ablation.log ;;
C2)  # call 1's hang: the ablation without c4, then c4 alone after the register fix
  timeout 280 python3 benchmarks/history/session55/dh_ablation.py 7b,30b 2 \
    default,no_epi,no_hload,pf8 > $OUT/dh_ablation.log 2>&1
  echo "dh ablation rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_ablation.log | tail -16
  grep "^|" $OUT/dh_ablation.log
  timeout 150 python3 benchmarks/history/session55/dh_ablation.py 7b,30b 1 \
    default,c4,c4s4 > $OUT/dh_c4.log 2>&1
  echo "dh c4 rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_c4.log | tail -10
  grep "^|" $OUT/dh_c4.log ;;
C3)  # C2 cut to ~6 min (the session's last device seconds)
  timeout 230 python3 benchmarks/history/session55/dh_ablation.py 7b,30b 2 \
    default,no_epi,pf8 > $OUT/dh_ablation.log 2>&1
  echo "dh ablation rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_ablation.log | tail -12
  grep "^|" $OUT/dh_ablation.log
  timeout 110 python3 benchmarks/history/session55/dh_ablation.py 7b 1 default,c4 \
    > $OUT/dh_c4.log 2>&1
  echo "dh c4 rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_c4.log | tail -6
  grep "^|" $OUT/dh_c4.log ;;
C4)  # C3 cut to ~3.7 min, 7B only
  timeout 130 python3 benchmarks/history/session55/dh_ablation.py 7b 2 \
    default,no_epi,pf8 > $OUT/dh_ablation.log 2>&1
  echo "dh ablation rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_ablation.log | tail -8
  grep "^|" $OUT/dh_ablation.log
  timeout 90 python3 benchmarks/history/session55/dh_ablation.py 7b 1 default,c4 \
    > $OUT/dh_c4.log 2>&1
  echo "dh c4 rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_c4.log | tail -6 ;;
R)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
  timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_small_batch_routing_kernel_equals_reference" > $OUT/gpu_routing.log 2>&1
  echo "gpu routing rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_routing.log
  bash benchmarks/history/session55/next_calls.sh D ;;
*)
  bash benchmarks/history/session55/next_calls.sh "$PART" ;;
esac
echo "session 56 part $PART done in $(( $(date +%s) - T0 )) s"
