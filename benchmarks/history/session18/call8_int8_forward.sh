# Call 8: the W8A8 int8 forward: GPU tests, then its time against fp8 and bf16 at 7B.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -p no:xdist -v -s -m gpu tests/test_quant_int8.py -k forward 2>&1 | grep -i "passed\|failed\|error\|assert\|int8 vs" | tail -10 > $OUT/gpu_tests.txt
timeout 120 python3 benchmarks/history/session18/int8_forward.py 2>&1 | grep "^|\|Error" > $OUT/int8_forward.txt
cat $OUT/gpu_tests.txt $OUT/int8_forward.txt
