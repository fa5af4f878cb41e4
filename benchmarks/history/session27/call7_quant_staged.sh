# Session 27, call 7 (issue 13): call 6's sampling of the kept kernel at 30B int8 (96
# registers, 5 CTAs per SM): 31% of the samples wait on the scale row's load (now issued in
# the row's own iteration), 7% on the reduction's barrier. Holding the row in registers a
# row ahead costs CTAs per SM (call 5: 0.93x at 30B). New: scale rows staged 1 or 2 rows
# ahead in SMEM by each thread's own cp.async of the elements it will hold (no registers,
# no barrier). Same run against session 26's kernel and the default, then the GPU tests
# (numpy bit for bit, with the staged configs).
export PYTHONPATH=. PYTHONUNBUFFERED=1
QUANT_GROUPS=s26,new,staged1,staged2,staged1bt2 timeout 300 \
  python3 benchmarks/history/session27/quant_groups.py $OUT 7b,30b,qwen3 > $OUT/ab_log.txt 2>&1
grep "^|" $OUT/ab_log.txt; grep -E "Error|Traceback|error" $OUT/ab_log.txt | head -5
timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "on_gpu" 2>&1 | tail -3
