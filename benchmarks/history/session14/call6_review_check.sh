set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
# After the review's refactor (one producer K step for both dH kernels): bitwise checks.
timeout 400 python3 -m pytest -p no:xdist -m gpu -v "tests/test_gpu.py::test_dh_persistent_equals_one_cta_per_tile[7b_widths-wait_group]" "tests/test_gpu.py::test_dh_persistent_equals_one_cta_per_tile[30b_widths-mbarrier]" "tests/test_gpu.py::test_dh_early_h_equals_after_the_k_loop" 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tee $OUT/gpu_tests.txt
