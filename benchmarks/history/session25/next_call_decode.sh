# Planned for the next session (issue 15): split K of the decode megakernel's up tasks
# (`DecodeConfig.up_split_k`, built in session 25, interpret-tested and lowered, never run on
# a GPU). First the GPU tests of the new variants (against xla on poisoned outputs, H, and
# 100 runs bitwise; a hang means a lost notify: hence the timeout), then T = 1-8 timings
# against the kernel path and today's megakernel. At T = 1 the 96 up tasks of 512 KB leave
# 36 SMs without W1 to stream (`docs/decode.md`, "Where T = 1 loses"); with S = 4, 384
# partial tasks of 128 KB. Prediction: 49 -> ~38-42 us at T = 1 (bound 25.7); no change
# from T = 8 on. If it wins at T = 1, make it the op's choice there (`moe_forward`).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 400 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py -k "split" 2>&1 | tail -4
timeout 180 python3 benchmarks/decode.py --out $OUT --tokens 1,2,4,8 \
  --variants kernels,static,static_split2,static_split4,dynamic_split4 2>&1 | grep "^|"
