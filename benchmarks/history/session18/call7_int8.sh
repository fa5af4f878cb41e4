# Call 7: call 6 again with the down-proj at its config's bf16 output and the 30B check on sampled rows.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -p no:xdist -v -m gpu tests/test_quant_int8.py 2>&1 | grep -i "passed\|failed\|error\|assert" | tail -10 > $OUT/gpu_tests.txt
timeout 200 python3 benchmarks/history/session18/int8_gemm.py $OUT 7b,30b 2>&1 | grep -v "^I0000\|^W0000\|^E1125" > $OUT/int8_gemm_stdout.txt
cat $OUT/gpu_tests.txt; tail -7 $OUT/int8_gemm_stdout.txt; grep -i error $OUT/int8_gemm_stdout.txt | head -5
