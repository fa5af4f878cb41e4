# Call 6: the grouped GEMM's int8 mode: GPU tests (int8, and the fp8 GEMM tests for regression) and the int8 vs e4m3 benchmark.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -p no:xdist -v -m gpu tests/test_quant_int8.py tests/test_quant_fp8.py -k "int8 or grouped_matmul_on_gpu or pingpong_down_on_gpu" 2>&1 | grep -i "passed\|failed\|error\|assert" | tail -20 > $OUT/gpu_tests.txt
timeout 300 python3 benchmarks/history/session18/int8_gemm.py $OUT 7b,30b 2>&1 | grep -v "^I0000\|^W0000" > $OUT/int8_gemm_stdout.txt
cat $OUT/gpu_tests.txt; tail -8 $OUT/int8_gemm_stdout.txt; grep -i error $OUT/int8_gemm_stdout.txt | head -5
