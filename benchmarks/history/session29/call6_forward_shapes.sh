# Session 29, call 6 (run inline): the forward's same-run ratios at the other benchmark
# shapes of `forward.py` (SHAPES) and the real-model widths (7B and 30B ran in call 2).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 400 python3 benchmarks/forward.py --out $OUT/fwd --shapes 7b-n512,30b-n256,w2880,7b-n1024,w7168 \
  --skew 7b --up-sweep none --down-sweep none 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/fwd.log
grep "^|" $OUT/fwd.log | tail -14; tail -3 $OUT/fwd.log
