# Session 21, call 4 (H100): at 30B (d = 4096, one CTA per tile by default) the persistent dH
# with the swizzled, cp.async-loaded epilogue, inside the whole step; its GPU bitwise test.
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "swizzled_epilogue and 30b" 2>&1 | tail -5 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
timeout 300 python3 benchmarks/step.py --shapes 30b --variants topk/cp_async,topk/cp_async/persistent-dh --out $OUT/step 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -8
