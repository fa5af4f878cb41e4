set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 280 python3 -m pytest -p no:xdist -m gpu -q tests/test_gpu.py -k "mosaic_matches_xla or backward_cp_async or backward_with_empty or dh_early_h" 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
timeout 300 python3 benchmarks/step.py --shapes 7b,30b --variants topk/cp_async --out $OUT/step 2>&1 | grep -v "^I0000\|^W0000" | tail -40
ls $OUT/step
