# Session 30, call 2. Issue 16: call 1's sweep stopped at a misspelled variant before the wide
# shapes; ncu said the default up-proj at 7b-n1024 has 1.38x the cycles of 7B, the same DRAM
# bytes and L1 traffic but ~1.3x the L2 throughput-time, with the consumers' full waits and the
# producer's empty waits both longer (loads in flight longer). A: the sweep at the wide shapes.
# B: every L2 / DRAM metric of the default at 7b and 7b-n1024 (ncu raw page), to name the
# extra L2 work. Issue 15: C, the decode GPU tests owed after session 29's publish refactor;
# D, the decode megakernel's named regions at T = 1 and 8. Issue 16: E, 30b-n256.
export PYTHONPATH=. PYTHONUNBUFFERED=1
date
P=up_pingpong+block_m=128+num_stages=4
timeout 200 python3 benchmarks/timeline.py --plain --out $OUT/wide --shapes 7b-n512,7b-n1024 \
  --kernels up,$P,$P+fused+interleaved,up_pingpong+fused+interleaved 2>&1 | tee $OUT/wide.log | grep "CUPTI\|^==\|Error"
date
for s in 7b 7b-n1024; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Chart \
    --section MemoryWorkloadAnalysis_Tables --kernel-name regex:moe_up_proj --launch-skip 1 \
    --launch-count 1 -o /tmp/l2_$s python3 benchmarks/timeline.py --run-only --out /tmp/tr \
    --shapes $s --kernels up > $OUT/ncu_l2_$s.log 2>&1
  ncu -i /tmp/l2_$s.ncu-rep --page raw --csv > $OUT/raw_$s.csv 2>/dev/null
  ncu -i /tmp/l2_$s.ncu-rep --page details --print-details all > $OUT/l2details_$s.txt 2>&1
  date
done
G=tests/test_gpu_decode.py
timeout 240 python3 -m pytest -p no:xdist -q -m gpu "$G::test_matches_xla[1-static]" \
  "$G::test_matches_xla[128-dynamic]" "$G::test_matches_xla[8-unfused]" \
  "$G::test_matches_xla[1-static_split4]" "$G::test_hundred_runs_no_hang_bitwise_equal[static]" \
  2>&1 | tail -3
date
timeout 150 python3 benchmarks/timeline.py --out $OUT/dec --shapes decode1,decode8 --kernels decode \
  > $OUT/dec.log 2>&1
date
timeout 200 python3 benchmarks/forward.py --out $OUT/fwd --shapes 30b-n256 --skew '' \
  --up-sweep none --down-sweep none 2>&1 | grep "^|" | tail -3
date
grep "CUPTI\|^==" $OUT/wide.log | sed 's/: UpProjConfig.*//'
python3 - $OUT/raw_7b.csv $OUT/raw_7b-n1024.csv <<'PY' 2>&1 | head -120
import csv, sys
def load(p):
    rows = list(csv.reader(l for l in open(p) if l.startswith('"')))
    return {h: (u, v) for h, u, v in zip(rows[0], rows[1], rows[2])}
a, b = load(sys.argv[1]), load(sys.argv[2])
keep = ("dram__bytes", "lts__t_sectors", "lts__t_requests", "lts__t_sector_hit", "lts__d_",
        "lts__ltcfabric", "lts__average", "lts__lts2xbar", "lts__xbar2lts", "l1tex__m_",
        "gpu__time_duration", "lts__t_tag")
for h in a:
    if (h.startswith(keep) or "breakdown" in h) and h in b:
        print(f"{h[:88]:88s} {a[h][0][:8]:8s} {a[h][1]:>16s} {b[h][1]:>16s}")
PY
grep -v "^WARNING\|^I0000\|^W0000\|cuda_event" $OUT/dec.log | tail -45
