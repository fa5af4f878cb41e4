# Planned for the next session. `bash next_calls.sh PART`; each part <= 10 min, logs under $OUT.
#   nvidia-h200:    S (issues 16 / 9: the bf16 down-proj and dX~ with one output slab staged
#                   at a time and the stage it frees), then history/session33/next_call_h200.sh
#                   A / B if time is left.
#   nvidia-h200-x2: E (issue 17: the all-gather dispatch's chunked overlap timed alone).
#   nvidia-h200-x8: history/session35/next_calls.sh X8.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
case "${1:-S}" in
S)
  # Session 36: `out_slabs=1` let the gated fp8 up-proj run 4 stages instead of 3 (30B
  # 1.03x, 7B 1.01-1.04x, bitwise). The bf16 down-proj (7B and 30B) and 7B dX~ run the
  # 128-row ping-pong with 5 stages of 32 KB beside 2 x 32 KB of output tiles; 30B dX~
  # split-M 256-column items with 3 stages of 48 KB beside 2 x 32 KB. Prediction: one more
  # stage (6 / 4) gives the down-proj 1.00-1.03x (its K loop is 4-8 steps, so the extra
  # stage mostly prefetches the next item) and 30B dX~ 1.02-1.04x (32 K steps per item,
  # like the fp8 up-proj); staging alone (same stages, out_slabs=1) <= 1% slower. Every
  # variant is checked against the reference in the benchmarks (bitwise expected).
  timeout 280 python3 benchmarks/forward.py --shapes 7b,30b --skew '' --up-sweep none \
    --down-sweep slabs --no-baselines --out /tmp/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep -i "down\b.*us\|down_sweep\|FAIL" $OUT/forward.log | tail -12
  timeout 280 python3 benchmarks/backward.py --shapes 7b,30b --sweep slabs --out /tmp/bw > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; grep "dX~\|FAIL" $OUT/backward.log | cut -c1-100,250-400 | tail -12
  cp /tmp/fw/forward_RESULTS.md $OUT/ 2>/dev/null; cp /tmp/bw/results.json $OUT/backward_results.json 2>/dev/null ;;
E)
  # Session 36 call 1 ran none / chunked (comm_sms 0, 16, 32) in five processes side by
  # side (compiles overlapping the timed turns): the trace showed the chunked mode hiding
  # 94-98% of the reduce-scatter (none: 24-46%), but the wall times scattered (one-GPU
  # baseline 26.7-32.4 ms across processes) and the forward was 5.41 ms none against
  # 5.67-5.81 chunked at strong scaling. One process, both modes, 20 iterations, nothing
  # beside it: does the chunked mode save time, at strong and weak scaling?
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout 560 \
    python3 benchmarks/ep.py --ep 2 --backend mosaic --dispatch all_gather --overlap none,chunked \
    --skip-check --iters 20 --out /tmp/ep/e.md > $OUT/e.log 2>&1
  echo "ep rc=$? at $(( $(date +%s) - T0 )) s"; cp /tmp/ep/e.md /tmp/ep/e.json $OUT/ 2>/dev/null
  grep "^|" /tmp/ep/e.md | cut -d'|' -f2-13 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
