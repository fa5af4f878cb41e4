# Session 29, call 3: call 2 found the TMA stores cost the K loops 6-16% (7B up 33 us, dH 65,
# dX~ 64) and, at 30B, not through HBM writes (storel2 ~ full). Two candidates: the
# epilogues' waits for the stores' SMEM reads (`nowait` drops them: timing only), or the TMA
# unit itself (`lsustore`: the warpgroup stores its tiles with 16-byte ld.shared/st.global,
# no TMA). Then the bits of the op with the LSU stores (they run first, fresh buffers).
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
timeout 260 python3 benchmarks/timeline.py --plain --out $OUT/ls --shapes 7b,30b --kernels \
  up,up_nowait,up_lsustore,dh,dh_nowait,dh_lsustore,dx,dx_nowait,dx_lsustore,down,down_lsustore 2>&1 \
  | tee $OUT/ls.log | grep "^|\|Error" | head -40
timeout 200 python3 benchmarks/history/session29/store_bits.py 7b,30b 2>&1 | $F | tee $OUT/sb.log | tail -12
