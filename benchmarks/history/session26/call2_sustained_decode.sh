# Session 26, call 2. (1) Issue 9: is the 7B step's pipelined-vs-kernel gap clocks under
# sustained load (call 1 found only 13 us/step of idle between kernels)? (2) Issue 15:
# session 25's owed run of the decode megakernel's split-K up tasks
# (`DecodeConfig.up_split_k`): the GPU tests of the new variants (against xla on poisoned
# outputs, 100 runs bitwise; a hang means a lost notify: hence the timeout), then T = 1-8
# against the kernel path and today's megakernel. Prediction: T = 1 from ~49 us to ~38-42 us
# (bound 25.7), no change from T = 8 on.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 90 python3 benchmarks/history/session26/sustained.py 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tail -14
timeout 320 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py -k "split" 2>&1 | tail -4
timeout 175 python3 benchmarks/decode.py --out $OUT --tokens 1,2,4,8 \
  --variants kernels,static,static_split2,static_split4,dynamic_split4 2>&1 | grep "^|"
