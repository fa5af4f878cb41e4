# Call 5: the two token-rounding fp8 forward GPU tests that call 3's time limit cut.
export PYTHONPATH=. PYTHONUNBUFFERED=1; timeout 400 python3 -m pytest -p no:xdist -v -m gpu tests/test_quant_fp8.py -k "token_rounding" 2>&1 | grep -i "passed\|failed\|error" | tail -8 | tee $OUT/gpu_tests_fp8_token_rounding.txt
