# Session 24, call 7 (the budget's last ~250 s): the new H200 default up-proj above d = 1536
# (persistent split-M on W1's halves) at d = 2880 (n = 1408), the width between the measured
# 2048 and 4096, against the cooperative kernel it replaces; then the op on the new default
# against the xla backend at d = 2048 (forward, gradients, bitwise repeat).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 80 python3 benchmarks/timeline.py --plain --out $OUT/t --shapes w2880 --kernels up,up_coop \
 2>&1 | grep "^|" | tee $OUT/t.txt
timeout 150 python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla_at_d_2048" > $OUT/gpu_tests.txt 2>&1
grep -E "PASS|FAIL|Error|passed|failed" $OUT/gpu_tests.txt | tail -5
