# Session 21, call 5 (H100): the persistent, swizzled dH as the default up to d = 4096: the
# backward against the jnp reference at 30B widths through the new default; the same A/B at
# d = 2880 (now persistent + swizzled) and d = 7168 (still one CTA per tile).
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_backward_cp_async and shape1" 2>&1 | tail -5 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
timeout 230 python3 benchmarks/history/session21/dh_epilogue_ab.py w7168 short 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/dh_epilogue_ab.txt
tail -8 $OUT/dh_epilogue_ab.txt
