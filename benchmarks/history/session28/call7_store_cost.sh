# Session 28, call 7: call 6 found the epilogue warpgroup's K loop as fast as a K loop with no
# epilogue once its stores are removed (474 vs 471 us): the stores, not the SwiGLU, cost the
# time. What the stores and the math cost today's default up-proj and the fused split-M one.
export PYTHONPATH=. PYTHONUNBUFFERED=1
P=up_pingpong+block_m=128+num_stages=4+fused+interleaved
timeout 200 python3 benchmarks/timeline.py --plain --out $OUT/st --shapes 7b,30b --kernels \
  up,up_nostore,up_nomath,$P,$P+nostore,$P+nomath 2>&1 | tee $OUT/st.log | grep "^|"
