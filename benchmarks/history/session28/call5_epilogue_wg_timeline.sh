# Session 28, call 5: why the epilogue warpgroup did not pay (call 4: 7B 1.008x, 30B 0.965x
# against the 4-stage split-M kernel): per-warpgroup region times (the consumers'
# `hand_off`, which includes their wait for the previous item's buffer, and the epilogue
# warpgroup's `epilogue_h` / `epilogue_math` / `epilogue_a`), 7B, beside the 4-stage kernel.
export PYTHONPATH=. PYTHONUNBUFFERED=1
P=up_pingpong+block_m=128+num_stages
E=epilogue_warpgroup=True+epilogue_tiles=0
timeout 220 python3 benchmarks/timeline.py --out $OUT/tl --traces /tmp/traces --shapes 7b --kernels \
  $P=3+$E,$P=4 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" > $OUT/tl.log
tail -60 $OUT/tl.log
