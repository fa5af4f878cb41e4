# Session 21, call 3 (H100): the swizzled, cp.async-loaded dH epilogue as the persistent
# default: GPU tests through the op and the backward, the 7B step before/after in one run,
# and the persistent kernel with it at 30B (where one CTA per tile is the default).
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
timeout 250 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "(test_mosaic_matches_xla and (0-True-topk or 1-True-token_rounding)) or (test_backward_cp_async and wait_group) or empty_experts_on_gpu" 2>&1 | tail -15 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
timeout 190 python3 benchmarks/step.py --shapes 7b --variants topk/cp_async,topk/cp_async/untiled-dh --out $OUT/step 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -8
timeout 130 python3 benchmarks/history/session21/dh_epilogue_ab.py 30b,7b short 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/dh_epilogue_ab.txt
tail -9 $OUT/dh_epilogue_ab.txt
