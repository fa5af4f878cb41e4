# Call 4: the persistent dH with swizzled epilogue tiles: A/B against the untiled tiles
# (bitwise, time), its timeline, and the GPU tests of the persistent kernel.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/history/session19/dh_tiles_ab.py 7b,30b 2>&1 | grep "^|\|Error\|error" > $OUT/dh_tiles_ab.txt
cat $OUT/dh_tiles_ab.txt
timeout 120 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels dh 2>&1 | grep "==\|CUPTI\|consumer0"
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "dh_persistent_equals or test_mosaic_matches_xla and 0-True-topk" 2>&1 | tail -4 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
