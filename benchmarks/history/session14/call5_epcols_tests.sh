set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 280 python3 benchmarks/history/session14/dh_persistent.py 7b,30b epcols 2>&1 | grep -v "^I0000\|^W0000" | tee $OUT/dh_epcols.txt | tail -14
timeout 290 python3 -m pytest -p no:xdist -m gpu -v "tests/test_gpu.py::test_mosaic_matches_xla[0-True-topk]" "tests/test_gpu.py::test_backward_cp_async_matches_reference[wait_group-shape0]" "tests/test_gpu.py::test_backward_cp_async_matches_reference[mbarrier-shape2]" tests/test_gpu.py::test_backward_with_empty_experts_on_gpu 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tee $OUT/gpu_tests.txt
