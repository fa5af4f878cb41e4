set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/step
timeout 260 python3 benchmarks/history/session16/sigmoid_ab.py 7b,30b 2>&1 | grep -v "^I0000\|^W0000" > $OUT/sigmoid_ab.txt
timeout 180 python3 benchmarks/step.py --shapes 7b,30b --variants topk/cp_async --out $OUT/step 2>&1 | grep -v "^I0000\|^W0000" | tail -12 > $OUT/step_log.txt
timeout 140 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla and topk" tests/test_gpu_decode.py::test_h_matches_the_kernel_path 2>&1 | tail -8 > $OUT/gpu_tests.txt
cat $OUT/sigmoid_ab.txt | tail -8; tail -5 $OUT/step_log.txt; cat $OUT/gpu_tests.txt
