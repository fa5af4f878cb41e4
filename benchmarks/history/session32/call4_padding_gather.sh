# Session 32, call 4 (issue 15): call 3 found the up tasks' cp.async gather holds ~20 of
# their 36 us at T = 1; the tile's 63 padding rows all read its one real row, so every SM's
# copies hit the same L2 lines. Now padding rows are zero-filled without reads
# (padding_gather.patch). (1) GPU tests of the megakernel (against xla, poisoned outputs,
# edge cases, 100 runs bitwise); (2) decode.py with the new code and the old (the patch
# reversed on a copy) in the same call, alternating.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -p no:xdist -q -m gpu "tests/test_gpu_decode.py::test_matches_xla[1-static]" \
  "tests/test_gpu_decode.py::test_matches_xla[8-static]" "tests/test_gpu_decode.py::test_matches_xla[64-static]" \
  "tests/test_gpu_decode.py::test_matches_xla[1-dynamic]" "tests/test_gpu_decode.py::test_matches_xla[8-unfused]" \
  "tests/test_gpu_decode.py::test_routing_edge_cases[static-skewed]" \
  tests/test_gpu_decode.py::test_hundred_runs_no_hang_bitwise_equal > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
rm -rf /tmp/old && mkdir /tmp/old && cp -r pallas_moe benchmarks /tmp/old/ && \
  (cd /tmp/old && patch -R -p1 < $OLDPWD/benchmarks/history/session32/padding_gather.patch > /dev/null) && \
  grep -c zero_negative /tmp/old/pallas_moe/kernels/decode.py
dec() {  # name, dir
  (cd $2 && timeout 100 python3 benchmarks/decode.py --out /tmp/d_$1 --tokens 1,8 \
     --variants static,dynamic --iters 50 > $OUT/decode_$1.log 2>&1)
  echo "== $1"; grep "^|" /tmp/d_$1/decode_RESULTS.md | sed -n 1,4p
}
dec new1 . ; dec old1 /tmp/old ; dec new2 .
