# Call 7: the quant forward GPU tests after the reference's bf16 rounding fix (round_bf16),
# printing the kernels' error against the XLA steps; then the evict_first stores again
# (the policy now made inside the store's PTX block).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -p no:xdist -v -s -m gpu tests/test_quant_int8.py tests/test_quant_fp8.py -k "forward_on_gpu" 2>&1 | grep -i "passed\|failed\|error\|assert\|vs xla\|rel" | tail -14 > $OUT/gpu_quant_forward.txt
cat $OUT/gpu_quant_forward.txt
timeout 300 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels up,up_evictfirst,dh,dh_evictfirst > $OUT/timeline_stdout.txt 2>&1
grep "==\|CUPTI\|consumer0 | k_loop\|consumer0 | epilogue_store\|consumer0 | store\|consumer0 | h_load\|fit\|Error" $OUT/timeline_stdout.txt
grep -B2 -A12 "Pass pipeline\|error:" $OUT/timeline_stdout.txt | head -40
