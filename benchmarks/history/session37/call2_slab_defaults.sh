# Session 37, call 2 (nvidia-h200): the H200's new defaults from call 1 (the ping-pong
# down-proj with one output slab staged at a time; the ping-pong dX~ with one slab and the
# 6th stage it frees) on the GPU tests, the sweeps again (default first now: a second run
# of call 1's comparison), and the whole 7B step both ways.
# Predictions: bitwise (tests); down-proj 1.01-1.02x, 7B dX~ 1.02-1.04x again; the 7B step
# 3.15 ms -> ~3.13 (5 + 17 us of kernels; the step's own spread is about as large).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
  "test_staged_output_slabs_equal_the_whole_tile_on_gpu or test_mosaic_matches_xla[0-True-topk]" \
  > $OUT/gpu_tests.log 2>&1; echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_tests.log
timeout 150 python3 benchmarks/forward.py --shapes 7b,30b --skew '' --up-sweep none \
  --down-sweep slabs --no-baselines --out /tmp/fw > $OUT/forward.log 2>&1
echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
timeout 100 python3 benchmarks/backward.py --shapes 7b --sweep slabs --out /tmp/bw > $OUT/backward.log 2>&1
echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
timeout 130 python3 benchmarks/step.py --out /tmp/st --shapes 7b \
  --variants topk/cp_async,topk/cp_async/whole-tile-down,topk/cp_async > $OUT/step.log 2>&1
echo "step rc=$? at $(( $(date +%s) - T0 )) s"
grep "  down Grouped" $OUT/forward.log | sed 's/GroupedMatmulConfig(block_m=128, block_n=128, block_k=64, //; s/num_sms=132, fp8_promote_every=1, gather=.cp_async., gather_completion=.wait_group., //' | cut -c1-160
grep "  dX~ Grouped" $OUT/backward.log | sed 's/GroupedMatmulConfig(block_m=128, block_n=128, block_k=64, //; s/num_sms=132, fp8_promote_every=1, gather=.cp_async., gather_completion=.wait_group., //' | cut -c1-160
grep "^|\|kernels" $OUT/step.log | tail -6 | cut -c1-300
echo "done in $(( $(date +%s) - T0 )) s"
