# Call 1: the SmoothQuant CSR kernel with the row scale on a splat and rcp.rn (quant_ab.py), GPU tests.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 330 python3 benchmarks/history/session18/quant_ab.py $OUT 7b,30b 2>&1 | grep -v "^I0000\|^W0000" > $OUT/quant_ab_stdout.txt
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py tests/test_quant_fp8.py 2>&1 | tail -15 > $OUT/gpu_tests.txt
tail -22 $OUT/quant_ab_stdout.txt; grep -i "error\|numpy" $OUT/quant_ab_stdout.txt | head; cat $OUT/gpu_tests.txt
