# Session 29, call 4. A: where the decode megakernel's warps wait at T = 1 (issue 15; call 2's
# stream probe: a bare TMA ring streams 29-31 GB/s per SM at 16-KB boxes and 5 stages, the
# megakernel's up tasks 13-18 GB/s), per SASS instruction. B: the op-level GPU test's cases
# owed since session 27's gather (seed 0 and d = 2048 passed in session 28).
export PYTHONPATH=. PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none --section WarpStateStats \
  --section SourceCounters --section LaunchStats --kernel-name regex:moe_decode --launch-skip 1 \
  --launch-count 1 -o /tmp/dec python3 benchmarks/history/session29/decode_run.py 1 3 \
  > $OUT/ncu_dec_log.txt 2>&1
ncu -i /tmp/dec.ncu-rep --page source --csv --print-source sass > /tmp/dec_sass.csv 2> /tmp/src_err.txt
python3 benchmarks/ncu_source.py /tmp/dec_sass.csv --listing 150 > $OUT/dec_stalls.txt 2>&1
cat /tmp/src_err.txt >> $OUT/dec_stalls.txt
gzip -c /tmp/dec_sass.csv > $OUT/dec_sass.csv.gz
ncu -i /tmp/dec.ncu-rep --page details > $OUT/dec_details.txt 2>&1
head -60 $OUT/dec_stalls.txt
timeout 330 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
  -k "test_mosaic_matches_xla and not 0-True and not d_2048" 2>&1 | tail -3
