# Session 24, call 6: the GPU equality test's remaining cases (call 5 passed shape0 and
# shape1 and reached its timeout in shape2; call 4, fused cases only, passed shape0-2):
# persistent split-M on halves and interleaved W1 against the cooperative kernel, bitwise,
# poisoned outputs, at d = 1536, 256 and 4096.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 420 python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu.py -k "test_up_proj_pingpong_equals_cooperative and (shape2 or shape3 or shape4)" --durations=5 > $OUT/gpu_tests.txt 2>&1
grep -E "PASS|FAIL|Error|error|passed|failed|s call" $OUT/gpu_tests.txt | tail -12
