# Session 30, call 3. Issue 16: `ForwardConfig.for_shape` now gives an H200 the persistent
# split-M up-proj at d <= 1536 from n = 512 on (call 2: 7b-n512 587.3 -> 527.6 us, 7b-n1024
# 637.1 -> 528.0). A: its GPU tests (the op's forward and gradients against xla at d = 1536,
# n = 1024; the kernel case at d = 1536, n = 512 bit for bit against the cooperative kernel)
# and the decode tests owed since session 29's publish refactor (call 2's output was lost to
# the tail limit). B: forward.py at the wide shapes against the ping-pong (the previous
# default) and ragged_dot_mgpu, and 30b-n256 (lost in session 29 and again in call 2).
export PYTHONPATH=. PYTHONUNBUFFERED=1
set -o pipefail
date
G=tests/test_gpu_decode.py
timeout 330 python3 -m pytest -p no:xdist -q -m gpu \
  tests/test_gpu.py::test_mosaic_matches_xla_with_wide_experts_at_d_1536 \
  "tests/test_gpu.py::test_up_proj_pingpong_equals_cooperative[shape2-5-1-mbarrier-False-0]" \
  "$G::test_matches_xla[1-static]" "$G::test_matches_xla[128-dynamic]" \
  "$G::test_matches_xla[8-unfused]" "$G::test_matches_xla[1-static_split4]" \
  "$G::test_hundred_runs_no_hang_bitwise_equal[static]" 2>&1 | tee $OUT/tests.log | tail -4
date
timeout 300 python3 benchmarks/forward.py --out /tmp/fw --shapes 7b-n512,7b-n1024 --skew '' \
  --up-sweep pingpong --down-sweep none > $OUT/fwd_wide.log 2>&1
cp /tmp/fw/forward_RESULTS.md $OUT/fwd_wide.md
date
timeout 200 python3 benchmarks/forward.py --out /tmp/fw30 --shapes 30b-n256 --skew '' \
  --up-sweep none --down-sweep none > $OUT/fwd_30b_n256.log 2>&1
cp /tmp/fw30/forward_RESULTS.md $OUT/fwd_30b_n256.md
date
grep "us\b.*TF/s\|UpProjConfig" $OUT/fwd_wide.log | grep -v "^|" | cut -c1-230 | tail -12
grep "^|" $OUT/fwd_wide.md $OUT/fwd_30b_n256.md | cut -d: -f2- | grep -v "^|---"
