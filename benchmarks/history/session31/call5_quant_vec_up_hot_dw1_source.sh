# Session 31, call 5 (each part tees its own log under $OUT; at most 8 files come back).
export PYTHONPATH=. PYTHONUNBUFFERED=1
# 1. Issue 13: the SmoothQuant default's vec is now 4 where 8 also fits (d % 1024 == 0): call 3
#    measured vec=4 1.058x at 30B (0.81 / 0.83 of copy). GPU tests at d = 2048 (default and
#    vec=8, every row bit for bit against numpy), then the A/B at four widths.
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py 2>&1 \
  | tee $OUT/quant_tests.log | tail -2
timeout 300 python3 benchmarks/quant.py --out /tmp/q --shapes 7b,30b,d2048,d7168 \
  --token-rounding '' > $OUT/quant.log 2>&1
grep "^|" $OUT/quant.log | tail -10; grep "csr SmoothQuantConfig\|^== " $OUT/quant.log \
  | grep -v "block_t=[24]\|block_pad=256" | sed 's/, scale_rows_ahead=0, int8_rounding=.fadd.//'
# 2. Issue 16 / 9: clocks as the step's context for the up-proj (session 30's open question).
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 20 \
  > $OUT/clocks.csv 2>&1 &
SMI=$!
timeout 200 python3 benchmarks/history/session31/up_hot.py 7b-n512,7b 2>&1 | tee $OUT/up_hot.log | grep "^|"
kill $SMI
# 3. Issue 9: dW1 at 7B (0.74 of its bound, the weakest backward kernel): where its warps
#    wait, per SASS instruction, after session 27's address fix.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none --section WarpStateStats \
  --section SourceCounters --kernel-name regex:moe_weight_grad_lhs --launch-skip 1 \
  --launch-count 1 -o /tmp/dw1src python3 benchmarks/history/session25/wg_run.py 7b \
  > $OUT/ncu_dw1_src.log 2>&1
ncu -i /tmp/dw1src.ncu-rep --page source --csv --print-source sass > /tmp/dw1src.csv 2>/dev/null
gzip -c /tmp/dw1src.csv > $OUT/dw1_source.csv.gz
python3 benchmarks/ncu_source.py /tmp/dw1src.csv --listing 300 > $OUT/dw1_source.txt 2>&1
head -40 $OUT/dw1_source.txt
