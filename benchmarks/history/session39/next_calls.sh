# Session 39. `bash benchmarks/history/session39/next_calls.sh PART` from the repo root; each
# part <= 10 min, logs under $OUT. For session 40 (one H200): P, then L, then
# `history/session37/next_calls.sh H` with `--rounds 5` whenever an H100 is lent.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
case "${1:-P}" in
P)
  # Issue 9: the ping-pong dH (`DHConfig.pingpong`, built in session 39, interpret-mode
  # bitwise against the cooperative kernel with the race detector, cuda lowering at 7B/30B;
  # never run on a GPU). Today's dH: per 7B item a ~9.7-us K loop, then a ~4.2-us epilogue
  # while the tensor cores idle (17.2 us per item in all; dH 417 us = 0.51 of its bound).
  # Prediction: the epilogue (4 chunks, each H load -> dSwiGLU -> stores, ~8-10 us for a
  # whole item) runs beside the other consumer's K loop: 7B dH 260-300 us (1.4-1.6x), 30B
  # 1700-1900 us (1.25-1.4x), the 7B step 2.95-3.0 ms. Refuted if slower than today: then
  # the epilogue spills beside two live accumulators (session 14's ping-pong, 1.85x slower);
  # ncu's local-memory metrics / `ptxas -v` on that build next.
  timeout 220 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k test_dh_pingpong_equals_the_cooperative_kernel_on_gpu 2>&1 | tail -3
  echo "gpu tests at $(( $(date +%s) - T0 )) s"
  timeout 240 python3 benchmarks/backward.py --shapes 7b,30b --sweep pingpong_dh --rounds 5 \
    --out /tmp/bw > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
  grep "  dH " $OUT/backward.log | sed 's/DHConfig(.*pingpong=/pingpong=/' | cut -c1-200
  timeout 120 python3 benchmarks/step.py --out /tmp/st --shapes 7b --rounds 5 \
    --variants topk/cp_async,topk/cp_async/pingpong-dh > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|paired over" $OUT/step.log | tail -6 ;;
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
