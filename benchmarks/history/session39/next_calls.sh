# Session 39. `bash benchmarks/history/session39/next_calls.sh PART` from the repo root; each
# part <= 10 min, logs under $OUT. For session 40 (one H200): L first, then
# `history/session37/next_calls.sh H` with `--rounds 5` whenever an H100 is lent.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
case "${1:-L}" in
L)
  # Issue 9: inside the 7B step the weight gradients take ~1.2x their isolated time (dW1
  # 0.62-0.64 ms against 0.53-0.55, dW2 0.35-0.36 against 0.29-0.30), dH 1.14x, the up-proj
  # 1.07x: ~0.3 ms of the 3.13-ms step, every session since 37 (step.py's breakdown against
  # backward.py / forward.py). Session 39's call 5 ruled out the plan: routed as the step
  # routes (groups 1308-1787 against 1419-1671), every backward kernel measured the same.
  # Hypothesis: an isolated loop finds the tail of its own previous call in the 50-MB L2
  # (dW1 reads X 75 MB + dH 200 MB); the step's kernels find other kernels' bytes there.
  # Prediction: with --flush-l2 256 dW1 0.60-0.64 ms, dW2 0.34-0.36, dH 0.47-0.49 (then the
  # isolated figures flatter and the lever is DRAM bytes per kernel); if they stay at the
  # unflushed times, the L2 is not it, and the step's clocks or kernel order are next.
  for flush in 0 256; do
    timeout 200 python3 benchmarks/backward.py --shapes 7b --sweep none --flush-l2 $flush \
      --out /tmp/bw$flush > $OUT/backward_flush$flush.log 2>&1
    echo "flush $flush rc=$? at $(( $(date +%s) - T0 )) s"
    grep "  dH \|  dW2 \|  dW1 \|  dX~ " $OUT/backward_flush$flush.log | sed 's/Config(.*)://'
  done
  for flush in 0 256; do  # the up-proj (1.07x in the step) and the down-proj, the same way
    timeout 120 python3 benchmarks/forward.py --shapes 7b --skew '' --up-sweep none \
      --down-sweep none --no-baselines --flush-l2 $flush --out /tmp/fw$flush \
      > $OUT/forward_flush$flush.log 2>&1
    echo "forward flush $flush rc=$? at $(( $(date +%s) - T0 )) s"; grep "^| 7b" $OUT/forward_flush$flush.log
  done ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
