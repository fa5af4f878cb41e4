# Session 28, call 2. Call 1's op-level test ran past its 200 s limit (7 cases); here the
# first seed of each router and the d=2048 case. Then session 27's items 5 and 4: what 3
# stages cost the split-M up-proj's K loop (decides the epilogue warpgroup), and where its
# producer now stalls.
export PYTHONPATH=. PYTHONUNBUFFERED=1
date
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py --durations=5 \
  -k "test_mosaic_matches_xla and (0-True or d_2048)" 2>&1 | tail -9
date
P=up_pingpong+block_m=128+fused+interleaved
timeout 170 python3 benchmarks/timeline.py --plain --out $OUT/st --shapes 7b,30b --kernels \
  up,$P+num_stages=4,$P+num_stages=3,$P+num_stages=4+noepilogue,$P+num_stages=3+noepilogue 2>&1 | tee $OUT/st.log | grep "^|"
date
k=$P+num_stages=4
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 ncu --clock-control none --section WarpStateStats \
  --section SourceCounters --kernel-name regex:moe_up_proj --launch-skip 1 --launch-count 1 \
  -o /tmp/up python3 benchmarks/timeline.py --run-only --out /tmp/tr --shapes 7b --kernels $k \
  > $OUT/ncu.log 2>&1
ncu -i /tmp/up.ncu-rep --page source --csv --print-source sass > /tmp/up.csv 2>/dev/null
python3 benchmarks/ncu_source.py /tmp/up.csv --top 25 --listing 1500 > $OUT/stalls_splitm.txt
head -60 $OUT/stalls_splitm.txt
date
