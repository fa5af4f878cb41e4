# Call 3: SmoothQuant CSR kernel without the next-token prefetch at one token per CTA, and
# without the X conversion hoist (quant_ab.py: s17, s18c, s18d, cur); GPU tests (quant, fp8).
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
QUANT_AB_BLOCKS=1,2 QUANT_AB_CASES="smoothed,X per token" timeout 240 python3 benchmarks/history/session18/quant_ab.py $OUT 7b,30b 2>&1 | grep -v "^I0000\|^W0000" > $OUT/quant_ab_stdout.txt
timeout 100 python3 -m pytest -p no:xdist -v -m gpu tests/test_quant.py -k "mosaic_kernel_matches_numpy or reciprocal" 2>&1 | grep -i "passed\|failed\|error" | tail -8 > $OUT/gpu_tests.txt
timeout 220 python3 -m pytest -p no:xdist -v -m gpu tests/test_quant_fp8.py 2>&1 | grep -i "passed\|failed\|error" | tail -20 >> $OUT/gpu_tests.txt
tail -14 $OUT/quant_ab_stdout.txt | grep "^|\|numpy\|error"; grep -i "error" $OUT/quant_ab_stdout.txt | head -3; cat $OUT/gpu_tests.txt
