# Call 9: GPU tests of the kernels that gained named regions (up-proj, persistent dH):
# forward and gradients against xla, and the persistent dH against one CTA per tile.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 420 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "(test_mosaic_matches_xla and 0-True-topk) or dh_persistent_equals or test_up_proj_cp_async" 2>&1 | tail -6 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
