# Session 36, call 3 (nvidia-h200): the fp8 up-proj's new default (4 stages, one output slab
# staged at a time; call 2: 30B 1.03x, bitwise) on the GPU tests (against the model of the
# fp8 sums, bitwise the old default, the whole forward), then the 7B figures call 2's
# timeout cut and the 30B forward on it. Prediction: 7B (12 K steps per item against 30B's
# 32) gains less, 1.00-1.03x; the 30B forward ~1.02x (the up-proj is ~45% of it).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant_fp8.py -k "out_slabs_on_gpu \
  or (test_fp8_grouped_matmul_on_gpu and gated_up and unpromoted) \
  or (test_fp8_forward_on_gpu and topk-per_token) or (test_fp8_forward_on_gpu and token_rounding-smoothquant)" \
  > $OUT/gpu_tests.log 2>&1; tail -3 $OUT/gpu_tests.log
timeout 400 python3 benchmarks/quant.py --fp8 --up-sweep --shapes 7b,30b --out /tmp/f > $OUT/fp8.log 2>&1
cp /tmp/f/*RESULTS.md /tmp/f/*.json $OUT/ 2>/dev/null; grep "^|" $OUT/fp8.log | tail -12; grep "up sweep:" $OUT/fp8.log | cut -c1-300
