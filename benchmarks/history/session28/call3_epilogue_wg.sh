# Session 28, call 3: the split-M up-proj's epilogue in a fourth warpgroup
# (`UpProjConfig.epilogue_warpgroup`, 3 stages + a 64-KB H hand-off buffer) against the
# 4-stage split-M kernel and the default, at 7B and 30B (CUPTI, one run); then the GPU test
# (bitwise against the cooperative kernel, poisoned outputs, with and without bias).
export PYTHONPATH=. PYTHONUNBUFFERED=1
date
P=up_pingpong+block_m=128+num_stages
E=epilogue_warpgroup=True+epilogue_tiles=0
timeout 200 python3 benchmarks/timeline.py --plain --out $OUT/st --shapes 7b,30b --kernels \
  up,$P=4+fused+interleaved,$P=3+fused+interleaved+$E,$P=3+$E,$P=3+fused+interleaved+$E+inference,$P=4+fused+interleaved+inference \
  2>&1 | tee $OUT/st.log | grep "^|"
date
timeout 240 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py --durations=5 \
  -k "pingpong_equals_cooperative and (shape1 or shape2 or shape4)" 2>&1 | tail -12
date
