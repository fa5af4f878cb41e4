# Session 29, call 2: where the stores cost the K loops (storel2: same stores onto an
# L2-resident footprint, against nostore and the full kernel), issue 15's streaming probe,
# and the forward's same-run ratios.
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
timeout 200 python3 benchmarks/timeline.py --plain --out $OUT/st --shapes 7b,30b --kernels \
  up,up_nostore,up_storel2,dx,dx_nostore,dx_storel2,dh,dh_nostore,dh_storel2 2>&1 \
  | tee $OUT/st.log | grep "^|"
timeout 150 python3 benchmarks/stream_probe.py --out $OUT/sp 2>&1 | $F | tee $OUT/sp.log | grep "^|\|copy" | tail -24
timeout 200 python3 benchmarks/forward.py --out $OUT/fwd --shapes 7b,30b --skew '' \
  --up-sweep none --down-sweep none 2>&1 | $F | tee $OUT/fwd.log | grep "^|" | tail -12
