# Call 10: after numerics.round_to (the xla backward's dX~ rows and the fp8/int8 epilogue
# reference): the kernels against the xla backend (forward and gradients), the numerics
# modes, and the int8/fp8 forward tests.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 480 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py tests/test_numerics_gpu.py tests/test_quant_int8.py -k "test_mosaic_matches_xla or mode_sum or unfused_swiglu or int8_forward_on_gpu" 2>&1 | tail -6 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
