# Planned for the next session (session 27's device time ran out after call 8).
# 1. The op on session 27's gather order (`_common._cp_async_rows`: every row's id and address
#    before the first copy; kernel GPU tests passed, the op-level one has not run on it):
#    forward, all four gradients and a bitwise repeat against the xla backend.
# 2. The whole 7B and 30B training step with its dense bound in the same run (session 26:
#    7B 3.266 ms on an H200; the five gathering kernels gained ~35 + 15 + 35 + 11 us at 7B in
#    isolation, so ~3.17 ms expected), and the forward kernels against their dense bounds
#    (the up-proj ~0.82 / ~0.84 of session 24's bound measurement; same-run ratio owed).
# 3. On an H100 (when lent): the same, against SonicMoE's 3.30 / 17.2 ms (issue 9's target is
#    <= 3.0 / 15.6 ms there).
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
timeout 240 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla" 2>&1 | tail -3
timeout 300 python3 benchmarks/step.py --out $OUT/step --shapes 7b,30b --variants topk/cp_async \
  2>&1 | $F | grep "^|\|kernels" | tail -6
timeout 200 python3 benchmarks/forward.py --out $OUT/fwd --shapes 7b,30b 2>&1 | $F | grep "^|" | tail -12
# 4. What is left in the up-proj's producer after the new order: call 1's sampling again on
#    the 7B default (ping-pong) and the split-M form, with a listing of the hot code.
for k in up up_pingpong+block_m=128+fused+interleaved+num_stages=4; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 ncu --clock-control none --section WarpStateStats \
    --section SourceCounters --kernel-name regex:moe_up_proj --launch-skip 1 --launch-count 1 \
    -o /tmp/up python3 benchmarks/timeline.py --run-only --out /tmp/tr --shapes 7b --kernels $k \
    > /dev/null 2>&1
  ncu -i /tmp/up.ncu-rep --page source --csv --print-source sass > /tmp/up.csv 2>/dev/null
  python3 benchmarks/ncu_source.py /tmp/up.csv --top 25 --listing 1500 > $OUT/stalls_${k%%+*}_$(echo $k | wc -c).txt
  rm -f /tmp/up.ncu-rep
done
# 5. Before building the split-M epilogue warpgroup (benchmarks/NOTES.md, session 27): what 3
#    stages instead of 4 cost its K loop now that the producer issues faster.
P=up_pingpong+block_m=128+fused+interleaved
timeout 150 python3 benchmarks/timeline.py --plain --out /tmp/st --shapes 7b,30b --kernels \
  $P+num_stages=4,$P+num_stages=4+noepilogue,$P+num_stages=3+noepilogue 2>&1 | grep "^|"
