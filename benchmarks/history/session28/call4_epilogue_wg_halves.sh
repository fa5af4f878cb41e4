# Session 28, call 4: call 3's fused form (one N = 256 wgmma) does not compile with 4
# warpgroups (ptxas C7602: 128 registers at launch, the instruction needs 154). W1's halves
# (two N = 128 wgmmas per step) with the epilogue warpgroup, against the default and the
# 4-stage split-M kernel, 7B and 30B; then the GPU test.
export PYTHONPATH=. PYTHONUNBUFFERED=1
date
P=up_pingpong+block_m=128+num_stages
E=epilogue_warpgroup=True+epilogue_tiles=0
timeout 200 python3 benchmarks/timeline.py --plain --out $OUT/st --shapes 7b,30b --kernels \
  up,$P=4,$P=4+fused+interleaved,$P=3+$E,$P=3+$E+inference,$P=4+inference \
  2>&1 | tee $OUT/st.log | grep "^|\|rror"
date
timeout 240 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py --durations=5 -x \
  -k "pingpong_equals_cooperative and (shape1 or shape2 or shape4)" 2>&1 | tail -12
date
