# Session 33 call 4 (issue 15): call 3 had the megakernel ahead of the kernel path up to
# T = 32 (1.07x at 16, 1.05x at 32, whole call); `H200_DECODE_MAX_TOKENS` 8 -> 32. (1) The
# op's default at T = 1, 32 (megakernel) and 33 (kernels) with gradients against xla, the
# megakernel against xla at T = 32 and the session-32 quick subset, NaN-poisoned outputs,
# 100 runs bitwise; (2) a second timing of T = 16-64 (the kernel path, the megakernel and
# the op's own choice, now the megakernel up to 32), twice in opposite orders.
export PYTHONPATH=. PYTHONUNBUFFERED=1
G=tests/test_gpu_decode.py
timeout 330 python3 -m pytest -p no:xdist -q -m gpu \
  "$G::test_moe_ffn_default_at_the_smallest_batches_matches_xla_with_gradients" \
  "$G::test_matches_xla[32-static]" "$G::test_matches_xla[1-static]" "$G::test_matches_xla[8-static]" \
  "$G::test_matches_xla[64-static]" "$G::test_matches_xla[1-dynamic]" "$G::test_matches_xla[8-unfused]" \
  "$G::test_routing_edge_cases[static-skewed]" "$G::test_hundred_runs_no_hang_bitwise_equal[static]" \
  > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
for run in 1 2; do
  [ $run = 1 ] && vs=kernels,static,auto || vs=auto,static,kernels
  timeout 110 python3 benchmarks/decode.py --out /tmp/d$run --tokens 16,32,64 --variants $vs \
    --iters 50 > $OUT/decode_limit$run.log 2>&1
  grep "^|" /tmp/d$run/decode_RESULTS.md | sed -n 1,5p
done
