# Session 37, call 3 (nvidia-h200): the rest of the GPU tests that run the H200's new
# ping-pong down-proj / dX~ defaults (the chunked EP down-proj calls, the op at d = 2048,
# empty experts), then the fp8 down-proj's one staged slab again (call 1: 30B 1.011x,
# bitwise; the 6th stage 0.99x). Prediction: tests pass; fp8 down 1.00-1.02x.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 220 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
  "test_chunked_row_ffn_equals_moe_ffn_bitwise or test_mosaic_matches_xla_at_d_2048 or test_backward_with_empty_experts_on_gpu" \
  > $OUT/gpu_tests.log 2>&1; echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -4 $OUT/gpu_tests.log
timeout 230 python3 benchmarks/quant.py --fp8 --down-sweep --shapes 30b --out /tmp/q > $OUT/fp8.log 2>&1
echo "fp8 rc=$? at $(( $(date +%s) - T0 )) s"; cp /tmp/q/fp8_RESULTS.md $OUT/ 2>/dev/null
grep "^|" $OUT/fp8.log | tail -9
echo "done in $(( $(date +%s) - T0 )) s"
