set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "shared_kernel_compilations" 2>&1 | tail -15 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
