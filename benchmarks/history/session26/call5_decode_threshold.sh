# Session 26, call 5 (issue 15): where does the megakernel beat the kernel path on an H200?
# Call 2 (same run): static 66.2 vs 67.1 us at T = 2, 102.5 vs 123.8 at T = 4, 166.8 vs 177.3
# at T = 8, where session 12's H100 found the kernel path faster from T = 2. The op's limit is
# now per device (`moe_forward.decode_max_tokens`, H200 tentatively 16); this measures T up to
# 64 and runs the op-level GPU test (default config against xla with gradients, T = 1-32:
# the megakernel at and below the limit, the kernel forward above; split up tasks at T = 1).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 250 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py -k "smallest_batches" 2>&1 | tail -4
timeout 300 python3 benchmarks/decode.py --out $OUT --tokens 1,2,4,8,16,32,64 \
  --variants kernels,static,auto 2>&1 | grep "^|"
