# Session 29, call 5: the stores cost the K loops 6-16% (call 2), not through HBM (storel2),
# the read waits (nowait) or the TMA unit (LSU stores: level, call 3). The two halves of a
# store alone, by the warpgroup's own accesses: lsuload (SMEM reads only), lsuwrite (GMEM
# writes only, no SMEM read), against nostore and the full kernel.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 260 python3 benchmarks/timeline.py --plain --out $OUT/h --shapes 7b,30b --kernels \
  up,up_nostore,up_lsuload,up_lsuwrite,dh,dh_nostore,dh_lsuload,dh_lsuwrite 2>&1 \
  | tee $OUT/h.log | grep "^|\|Error" | head -30
timeout 120 python3 benchmarks/timeline.py --plain --out $OUT/x --shapes 7b --kernels \
  dx,dx_nostore,dx_lsuwrite,dx_lsuload 2>&1 | grep -v "cuda_event\|cuda_executor\|custom_call" \
  | tee $OUT/x.log | grep "^|\|Error" | head -12
