# Session 27, call 1 (diagnosis before building).
# A. Session 26's owed Nsight Compute run on the SmoothQuant kernel (issue 13): registers,
#    occupancy limiter, stall reasons, preallocation off.
# B. Where the warps of the persistent split-M up-proj (7B; issue 16's best K loop) wait:
#    ncu's PC sampling per SASS instruction (never measured: session 24's WarpStateStats
#    attempt died on CUPTI). Consumers waiting on `full` barriers vs on wgmma waits, the
#    producer on `empty` barriers vs on LDGSTS throttles, decide what the contention is.
# C. The same kernel's in-kernel timeline (epilogue breakdown), and its K loop with half
#    the weight bytes (does a 2-CTA weight multicast pay for split M? Session 21's test
#    was on the 64-row ping-pong only).
export PYTHONPATH=. PYTHONUNBUFFERED=1
P=up_pingpong+block_m=128+fused+interleaved+num_stages=4
S=benchmarks/history/session27
bash benchmarks/history/session26/next_call_quant_ncu.sh > $OUT/quant_summary.txt 2>&1
echo "A done $(date +%T)"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 ncu --clock-control none --section WarpStateStats \
  --section SourceCounters --kernel-name regex:moe_up_proj --launch-skip 1 --launch-count 1 \
  -o /tmp/up python3 benchmarks/timeline.py --run-only --out /tmp/tr --shapes 7b --kernels $P \
  > $OUT/ncu_up_log.txt 2>&1
ncu -i /tmp/up.ncu-rep --page source --csv --print-source sass > /tmp/up_sass.csv 2> /tmp/src_err.txt
python3 benchmarks/ncu_source.py /tmp/up_sass.csv > $OUT/up_stalls.txt 2>&1
cat /tmp/src_err.txt >> $OUT/up_stalls.txt
gzip -c /tmp/up_sass.csv > $OUT/up_sass.csv.gz
ncu -i /tmp/up.ncu-rep --page details > $OUT/up_details.txt 2>&1
echo "B done $(date +%T)"
timeout 200 python3 benchmarks/timeline.py --out /tmp/tc --shapes 7b --kernels $P > /dev/null 2>&1
cp /tmp/tc/timeline_log.txt $OUT/tc_log.txt
timeout 200 python3 benchmarks/timeline.py --plain --out /tmp/tp --shapes 7b --kernels \
  $P+noepilogue,$P+noepilogue+halfweights,$P+noepilogue+nomma,$P+noepilogue+nomma+halfweights,$P+noepilogue \
  2>&1 | grep "^|" > $OUT/tplain.txt
echo "C done $(date +%T)"
head -60 $OUT/up_stalls.txt; grep -i -A30 "warp state" $OUT/up_details.txt | head -40
cat $OUT/quant_summary.txt | head -60
grep -v "^ *$" $OUT/tc_log.txt | head -60
cat $OUT/tplain.txt
