# Session 33 calls 5-8 (commands given inline to the device tool, recorded here).
# Call 5 (issues 16 / 9): session 31's prepared ncu of the up-proj inside the 7b-n512 step;
# ncu's application replay segfaulted the program (as session 27's 7B profile did).
bash benchmarks/history/session31/next_call_h200.sh A
# Call 6 (issue 13): session 31's SmoothQuant ncu (registers, occupancy, SASS samples).
bash benchmarks/history/session31/next_call_h200.sh C
# Call 7 (issue 15): the rest of the megakernel's GPU tests (edge cases, H, early weights,
# 100 runs per variant).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 440 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py \
  -k "not matches_xla and not smallest_batches" > $OUT/gpu_decode_2.log 2>&1
# Call 8: the test_matches_xla cases call 4 did not run (the -k filter also dropped
# 128-static, run alone after it).
timeout 320 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py -k "matches_xla and \
  not smallest_batches and not 1-static and not 8-static and not 32-static and not 64-static \
  and not 1-dynamic and not 8-unfused" > $OUT/gpu_decode_1.log 2>&1
timeout 120 python3 -m pytest -p no:xdist -q -m gpu "tests/test_gpu_decode.py::test_matches_xla[128-static]"
# Call 9 (issue 15, the session's last 312 s): decode_context.py at T = 1, cut by its
# timeout after round 0's first four programs (the fifth, `op`, and rounds 1-2 not run).
timeout 150 python3 benchmarks/history/session33/decode_context.py --out $OUT --tokens 1 --iters 40
