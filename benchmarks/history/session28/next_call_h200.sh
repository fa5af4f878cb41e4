# Planned for the next H200 session (session 28 ran out of device time after call 7).
# 1. Where the stores cost the K loops (session 28, call 6: the up-proj's stores cost ~53 us
#    of the 7B split-M K loop even from a warpgroup of their own). `storel2` keeps every
#    store but folds its rows into the first 4096 of the output, a footprint L2 absorbs:
#    storel2 ~ nostore -> the HBM write traffic / L2 capacity is the cost (then: fewer or
#    later write-backs); storel2 ~ full -> issuing the stores / L2 bandwidth is.
#    dX~ writes twice the up-proj's bytes per FLOP (604 MB at 7B), so it is in the table too.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 240 python3 benchmarks/timeline.py --plain --out $OUT/st --shapes 7b,30b --kernels \
  up,up_nostore,up_storel2,dx,dx_nostore,dx_storel2,dh,dh_nostore,dh_storel2 2>&1 \
  | tee $OUT/st.log | grep "^|"
# 2. Same-run dense-bound ratios of the forward kernels at every benchmark shape (session
#    28's forward.py with its sweeps ran past 140 s for 7B alone).
timeout 300 python3 benchmarks/forward.py --out $OUT/fwd --shapes 7b,30b --skew 7b \
  --up-sweep none --down-sweep none 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/fwd.log \
  | grep "^|" | tail -12
# 3. The op-level test's remaining cases on session 27's gather (seed 0 and d = 2048 passed in
#    session 28's call 2).
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
  -k "test_mosaic_matches_xla and not 0-True and not d_2048" 2>&1 | tail -3
