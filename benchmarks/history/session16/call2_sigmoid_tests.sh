set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 280 python3 benchmarks/history/session16/sigmoid_ab.py 7b,30b 2>&1 | grep -v "^I0000\|^W0000" > $OUT/sigmoid_ab.txt
timeout 280 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla and topk" tests/test_gpu_decode.py::test_h_matches_the_kernel_path tests/test_gpu_decode.py::test_moe_ffn_default_at_the_smallest_batches_matches_xla_with_gradients 2>&1 | tail -8 > $OUT/gpu_tests.txt
head -4 $OUT/sigmoid_ab.txt; grep h_bitwise $OUT/sigmoid_ab.txt; grep rel_diff $OUT/sigmoid_ab.txt; tail -7 $OUT/sigmoid_ab.txt; cat $OUT/gpu_tests.txt
