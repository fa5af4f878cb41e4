# Session 55's GPU calls: `bash benchmarks/history/session55/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   N: session 54's part N (gpt-oss lag-0 GPU tests, gpt-oss step default vs lag1-forward,
#      quant.py at 7B): `benchmarks/history/session54/next_calls.sh N`.
#   A (~7 min, H100): what dH's per-item epilogue costs today (issue 9): the default
#      persistent dH against its ablations (no H load, no dSwiGLU math, no stores, none of
#      them) and the new opt-in L2 prefetch of each item's H rows (`h_prefetch_steps` 4, 8)
#      at 7B and 30B, paired over 3 rounds (`dh_ablation.py`); then the prefetch's GPU test
#      (bitwise the default, poisoned outputs, 132 and 8 CTAs).
#   F (~5 min, H100): session 39's part L, never run: the backward kernels at 7B timed
#      plainly and after a 256-MB XLA pass (`backward.py --flush-l2`): are the isolated
#      figures flattered by their own previous call's bytes in the L2 (the step runs its
#      weight gradients ~1.2x and dH ~1.15x slower than alone)?
#   D (~4 min, H100): issue 15 at T = 1 and 2: split K of the megakernel's up tasks
#      (`up_split_k` 2 and 4, and 128-column up tasks split 2) against the default, twice in
#      opposite orders. Never measured on an H100, nor on any card since session 32 removed
#      the gather hot spot that every earlier T = 1 verdict ran with.
#   C (~8 min, one call when few device seconds are left; H100 or H200): part N's never-run
#      GPU test (the up-proj's lag-0 default at gpt-oss widths, bitwise the other lag), part
#      A with four variants over 2 rounds, and the prefetch's GPU test at the 7B widths.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-A}
case "$PART" in
N)
  bash benchmarks/history/session54/next_calls.sh N ;;
A)
  timeout 400 python3 benchmarks/history/session55/dh_ablation.py 7b,30b 3 > $OUT/dh_ablation.log 2>&1
  echo "dh ablation rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_ablation.log | tail -18
  grep "^|" $OUT/dh_ablation.log
  timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "h_prefetch" \
    > $OUT/gpu_h_prefetch.log 2>&1
  echo "gpu h_prefetch rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_h_prefetch.log ;;
F)
  for flush in 0 256; do
    timeout 250 python3 benchmarks/backward.py --shapes 7b --sweep none --flush-l2 $flush \
      --out $OUT/bw_flush$flush > $OUT/bw_flush$flush.log 2>&1
    echo "flush $flush rc=$? at $(( $(date +%s) - T0 )) s"
    grep "^| 7b" $OUT/bw_flush$flush.log | tail -2
  done ;;
C)
  timeout 140 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_up_proj_wgmma_lag_0_writes_the_default_bits and gpt_oss" > $OUT/gpu_lag_gpt_oss.log 2>&1
  echo "gpu up-proj lag gpt-oss rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_lag_gpt_oss.log
  timeout 230 python3 benchmarks/history/session55/dh_ablation.py 7b,30b 2 \
    default,no_hload,no_epi,pf8 > $OUT/dh_ablation.log 2>&1
  echo "dh ablation rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_ablation.log | tail -14
  grep "^|" $OUT/dh_ablation.log
  timeout 80 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "h_prefetch and 7b" > $OUT/gpu_h_prefetch.log 2>&1
  echo "gpu h_prefetch rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_h_prefetch.log ;;
E)  # part C cut to ~5.5 min (the session's last device seconds)
  timeout 130 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_up_proj_wgmma_lag_0_writes_the_default_bits and gpt_oss" > $OUT/gpu_lag_gpt_oss.log 2>&1
  echo "gpu up-proj lag gpt-oss rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_lag_gpt_oss.log
  timeout 200 python3 benchmarks/history/session55/dh_ablation.py 7b,30b 2 \
    default,no_epi,pf8 > $OUT/dh_ablation.log 2>&1
  echo "dh ablation rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_ablation.log | tail -12
  grep "^|" $OUT/dh_ablation.log ;;
G)  # the last ~4 min: the lag test, then the ablation at 7B only
  timeout 120 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_up_proj_wgmma_lag_0_writes_the_default_bits and gpt_oss" > $OUT/gpu_lag_gpt_oss.log 2>&1
  echo "gpu up-proj lag gpt-oss rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_lag_gpt_oss.log
  timeout 120 python3 benchmarks/history/session55/dh_ablation.py 7b 2 \
    default,no_epi,pf8 > $OUT/dh_ablation.log 2>&1
  echo "dh ablation rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_ablation.log | tail -8
  grep "^|" $OUT/dh_ablation.log ;;
D)
  V=static,static_split2,static_split4,static_u128_split2
  R=static_u128_split2,static_split4,static_split2,static
  i=0
  for vs in $V $R; do
    i=$((i + 1))
    timeout 250 python3 benchmarks/decode.py --tokens 1,2 --iters 30 --variants $vs \
      --out $OUT/dec$i > $OUT/dec$i.log 2>&1
    echo "decode run $i ($vs) rc=$? at $(( $(date +%s) - T0 )) s"
    grep "^  static" $OUT/dec$i.log | cut -c1-60
  done ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
