# Session 27, call 3 (issue 13): call 2's profile of the SmoothQuant CSR kernel (7B e4m3:
# 66% issue-active, ~120 instructions per row per warp; per row four warpgroup barriers: two
# in the reduction, two that Pallas puts before the Q and s stores; 22% of stall samples in
# the CTA's dependent offsets -> expert id -> scale-row chain). Same run: today's default,
# auto barriers off, and grouped rows (R rows' maxima in one exchange, R = 1, 2, 4, 8;
# R = 4 with auto barriers; R = 4 with two tokens per CTA). Then the GPU tests (numpy, bits).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 420 python3 benchmarks/history/session27/quant_groups.py $OUT 7b,30b > $OUT/ab_log.txt 2>&1
grep "^|" $OUT/ab_log.txt; grep -E "Error|Traceback" $OUT/ab_log.txt | head -5
timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "on_gpu" 2>&1 | tail -3
