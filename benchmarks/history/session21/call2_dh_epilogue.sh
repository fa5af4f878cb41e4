# Session 21, call 2: the persistent dH's swizzled epilogue slabs with H loaded by the
# consumers' cp.async (new) or by the TMA ladder (session 19), against the untiled default:
# GPU bitwise tests, the same-run A/B, and the timeline of the default and the cp.async form.
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "swizzled_epilogue" 2>&1 | tail -15 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
timeout 260 python3 benchmarks/history/session21/dh_epilogue_ab.py 7b,7b+skew,qwen3-30b-a3b 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/dh_epilogue_ab.txt
tail -14 $OUT/dh_epilogue_ab.txt
timeout 120 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels dh,dh_hcpasync 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | grep "CUPTI\|consumer0\|producer" 
