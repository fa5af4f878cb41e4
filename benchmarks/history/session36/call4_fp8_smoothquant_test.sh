# Session 36, call 4 (nvidia-h200, the last ~350 s of device time): call 3's 170-s test
# timeout cut the SmoothQuant forward test, the one that runs the new default up-proj
# (4 stages, one output slab staged) on contiguous (not gathered) rows.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant_fp8.py \
  -k "test_fp8_forward_on_gpu and smoothquant" > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
