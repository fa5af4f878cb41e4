# Planned for the next H200 session (session 29 ran out of device time after call 6).
export PYTHONPATH=. PYTHONUNBUFFERED=1
# 1. Issue 16: the up-proj at the 7B shapes with wider experts is far below the 7B shape's
#    0.81 (call 6, same-run dense bound): 7b-n512 0.67 (0.90x ragged_dot_mgpu), 7b-n1024 0.62
#    (0.81x). `ForwardConfig.for_shape` gives every d <= 1536 the 64-row ping-pong; its items'
#    bytes per FLOP do not depend on n, so the cause is open. Candidates with 128-row items
#    (half the weight bytes per FLOP): the persistent split-M kernel (the H200's choice above
#    d = 1536), fused or on W1's halves. If neither closes the gap, ncu_source.py on the
#    default at 7b-n1024 against 7b.
P=up_pingpong+block_m=128+num_stages=4
timeout 240 python3 benchmarks/timeline.py --plain --out $OUT/wide --shapes 7b-n512,7b-n1024 \
  --kernels up,$P,$P+fused+interleaved 2>&1 | tee $OUT/wide.log | grep "^|"
# If one wins at both: make it `for_shape`'s choice for n >= 512 at d <= 1536 on the H200,
#    then the GPU tests (`-m gpu -k "up_proj or pingpong"`) and forward.py at those shapes.
# 2. 30b-n256, which call 6 lost to an OOM in the harness's dense bound (fixed: measured first).
timeout 300 python3 benchmarks/forward.py --out $OUT/fwd --shapes 30b-n256 --skew '' \
  --up-sweep none --down-sweep none 2>&1 | grep "^|" | tail -4
# 3. Issue 15. First the decode kernel after session 29's refactor: its cp.async publish is
#    now `_common.cp_async_publish` / `_rest` (the same barrier index, g0 + (k - lag)
#    instead of (g0 + k) - lag; otherwise the same jaxpr), so the GPU tests run first.
G=tests/test_gpu_decode.py
timeout 240 python3 -m pytest -p no:xdist -q -m gpu "$G::test_matches_xla[1-static]" \
  "$G::test_matches_xla[128-dynamic]" "$G::test_matches_xla[8-unfused]" \
  "$G::test_matches_xla[1-static_split4]" "$G::test_hundred_runs_no_hang_bitwise_equal[static]" \
  2>&1 | tail -3
#    Then where the decode megakernel's producer spends each K step at T = 1 and 8 (its
#    named regions, new in session 29: post_wait, ids, empty_wait, weights, gather, publish,
#    event_wait; consumers: task_wait, k_loop, epilogue, event_wait). The stream probe says a
#    bare ring streams ~31 GB/s per SM at 16-KB steps, the megakernel ~13-18: the regions
#    say whether the producer waits on `empty` (consumers slow to release), on its own
#    cp.async groups (`publish`), or issues slowly (`weights`, `gather`).
timeout 200 python3 benchmarks/timeline.py --out $OUT/dec --shapes decode1,decode8 --kernels decode \
  2>&1 | tee $OUT/dec.log | grep -v "^WARNING\|^I0000\|^W0000" | tail -60
