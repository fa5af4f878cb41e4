# Session 30, call 1 (issue 16). The up-proj at the 7B shapes with wider experts (7b-n512,
# 7b-n1024: same rows per expert, same item count and bytes per FLOP as 7B) ran at 0.67 / 0.62
# of the dense bound against 7B's 0.81 (session 29, call 6). A: the 128-row persistent split-M
# kernel (the H200's choice above d = 1536) on W1's halves and fused on interleaved W1, and the
# fused ping-pong, against the default, 7B in the same run. B: where the default's warps wait
# and what L2 / DRAM do, at 7b and 7b-n1024 (ncu: SpeedOfLight, MemoryWorkloadAnalysis, source).
export PYTHONPATH=. PYTHONUNBUFFERED=1
date
P=up_pingpong+block_m=128+num_stages=4
timeout 260 python3 benchmarks/timeline.py --plain --out $OUT/wide --shapes 7b,7b-n512,7b-n1024 \
  --kernels up,$P,$P+fused+interleaved,up+fused+interleaved 2>&1 | tee $OUT/wide.log | grep "^|"
date
for s in 7b 7b-n1024; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 ncu --clock-control none --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
    --section SourceCounters --kernel-name regex:moe_up_proj --launch-skip 1 --launch-count 1 \
    -o /tmp/up_$s python3 benchmarks/timeline.py --run-only --out /tmp/tr --shapes $s --kernels up \
    > $OUT/ncu_$s.log 2>&1
  ncu -i /tmp/up_$s.ncu-rep --page details > $OUT/details_$s.txt 2>&1
  ncu -i /tmp/up_$s.ncu-rep --page source --csv --print-source sass > /tmp/up_$s.csv 2>/dev/null
  python3 benchmarks/ncu_source.py /tmp/up_$s.csv --top 25 > $OUT/stalls_$s.txt 2>&1
  date
done
for s in 7b 7b-n1024; do
  echo "== $s"; grep -E "Duration|DRAM Throughput|L2 Hit Rate|L1/TEX Hit|Memory Throughput|L2 Cache Throughput|Compute \(SM\)|Mem Busy|Max Bandwidth|Mem Pipes" $OUT/details_$s.txt | head -14
  head -22 $OUT/stalls_$s.txt
done
