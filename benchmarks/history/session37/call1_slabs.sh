# Session 37, call 1 (nvidia-h200): session 36's prepared part S plus the fp8 down-proj.
# One staged output slab per consumer (`out_slabs=1`) frees a pipeline stage:
#  - bf16 down-proj (7B, 30B: 128-row ping-pong, 5 -> 6 stages) and dX~ (7B ping-pong 5 -> 6;
#    30B split M, 256 columns, 3 -> 4). Prediction (session 36): down-proj 1.00-1.03x,
#    30B dX~ 1.02-1.04x, staging alone <= 1% slower. Bitwise expected.
#  - fp8 down-proj (30B: ping-pong 5 -> 6 stages; 7B: split M, 256 columns, 3 -> 4; both fit,
#    CPU lowering). Prediction: 30B 1.02-1.05x (4 K blocks of 128 per item: like the bf16
#    down-proj, mostly the next item's prefetch), 7B 1.03-1.06x (3 stages is shallow, 2 K
#    blocks per item). Bitwise expected.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 200 python3 benchmarks/quant.py --fp8 --down-sweep --shapes 30b,7b --out /tmp/q > $OUT/fp8.log 2>&1
echo "fp8 rc=$? at $(( $(date +%s) - T0 )) s"; cp /tmp/q/fp8_RESULTS.md $OUT/ 2>/dev/null
grep "down sweep " $OUT/fp8.log | cut -c1-200
timeout 190 python3 benchmarks/forward.py --shapes 7b,30b --skew '' --up-sweep none \
  --down-sweep slabs --no-baselines --out /tmp/fw > $OUT/forward.log 2>&1
echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; cp /tmp/fw/forward_RESULTS.md $OUT/ 2>/dev/null
timeout 190 python3 benchmarks/backward.py --shapes 7b,30b --sweep slabs --out /tmp/bw > $OUT/backward.log 2>&1
echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; cp /tmp/bw/results.json $OUT/backward_results.json 2>/dev/null
grep -i "down.*us\|FAIL" $OUT/forward.log | cut -c1-220 | tail -10
grep -i "dX~\|FAIL" $OUT/backward.log | cut -c1-220 | tail -10
grep "^|" $OUT/fp8.log | tail -14
echo "done in $(( $(date +%s) - T0 )) s"
