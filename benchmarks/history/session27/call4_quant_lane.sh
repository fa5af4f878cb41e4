# Session 27, call 4 (issue 13): call 3 found grouped rows slower (R = 2, 4, 8: 0.91x, 0.79x,
# 0.52x; more live registers, no prefetch across groups), auto barriers off 1.02-1.04x, and
# the grouped form's R = 1 (Lane semantics, scale row loaded with its row) 1.08-1.10x at
# 30B, level at 7B. Which part: Lane semantics, or the scale row not held a row ahead
# (registers: 133 per thread and 3 CTAs per SM at 30B)? Same run: today's default, auto
# barriers off, the row loop in Lane semantics with scale rows 1 or 0 rows ahead, one or
# two tokens per CTA, and the R = 1 group. Then the GPU tests.
export PYTHONPATH=. PYTHONUNBUFFERED=1
QUANT_GROUPS=cur,nab,lane1,lane0,g1,lane1bt2,lane0bt2,cur timeout 400 \
  python3 benchmarks/history/session27/quant_groups.py $OUT 7b,30b > $OUT/ab_log.txt 2>&1
grep "^|" $OUT/ab_log.txt; grep -E "Error|Traceback" $OUT/ab_log.txt | head -5
timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "on_gpu" 2>&1 | tail -3
