# Planned for the next H200 session (session 28 ran out of device time after call 7).
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
# 1. Paired f32 -> bf16 conversions (`timeline.packed_bf16_conversions`: one
#    cvt.rn.bf16x2.f32 per register instead of two F2F.BF16.F32 + PRMT, which session 27's
#    sampling found in the up-proj's SwiGLU epilogue; call 7 put that epilogue's math at 5%
#    of the 30B up-proj). First the bits (the op's forward and four gradients, both ways),
#    then every kernel that rounds accumulators to bf16, both ways. If it gains: make it the
#    library's conversion (a `_common` helper at the epilogues' astype calls), GPU suite.
timeout 200 python3 benchmarks/history/session28/packed_bf16.py 7b,30b 2>&1 | $F | tail -10
timeout 240 python3 benchmarks/timeline.py --plain --out $OUT/pk --shapes 7b,30b --kernels \
  up,up_packedbf16,dh,dh_packedbf16,down,down_packedbf16,dx,dx_packedbf16 2>&1 \
  | tee $OUT/pk.log | grep "^|"
# 1b. Issue 13: the SmoothQuant kernel with the next scale row prefetched into L1
#    (`SmoothQuantConfig.prefetch_scale_rows`, built in session 28, interpret-tested only),
#    against the default, bitwise and against numpy; then its GPU test. If it gains at every
#    width, make it the default.
timeout 240 python3 benchmarks/history/session28/quant_prefetch.py $OUT/qp 7b,30b,qwen3 \
  > $OUT/qp_log.txt 2>&1; grep "^|" $OUT/qp_log.txt; grep -E "Error|Traceback" $OUT/qp_log.txt | head -3
timeout 120 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "prefetch or default" 2>&1 | tail -2
# 2. Where the stores cost the K loops (session 28, call 6: the up-proj's stores cost ~53 us
#    of the 7B split-M K loop even from a warpgroup of their own). `storel2` keeps every
#    store but folds its rows into the first 4096 of the output, a footprint L2 absorbs:
#    storel2 ~ nostore -> the HBM write traffic / L2 capacity is the cost; storel2 ~ full ->
#    issuing the stores / L2 bandwidth is. dX~ writes twice the up-proj's bytes per FLOP
#    (604 MB at 7B), so it is in the table too.
timeout 240 python3 benchmarks/timeline.py --plain --out $OUT/st --shapes 7b,30b --kernels \
  up,up_nostore,up_storel2,dx,dx_nostore,dx_storel2,dh,dh_nostore,dh_storel2 2>&1 \
  | tee $OUT/st.log | grep "^|"
# 3. (next call) Same-run dense-bound ratios of the forward kernels at every benchmark shape
#    (forward.py with its sweeps ran past 140 s for 7B alone), and the op-level test's
#    remaining cases on session 27's gather (seed 0 and d = 2048 passed in session 28).
# timeout 300 python3 benchmarks/forward.py --out $OUT/fwd --shapes 7b,30b --skew 7b \
#   --up-sweep none --down-sweep none 2>&1 | $F | tee $OUT/fwd.log | grep "^|" | tail -12
# timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
#   -k "test_mosaic_matches_xla and not 0-True and not d_2048" 2>&1 | tail -3
# 4. Issue 15 (T = 1 at 1.9x the weight-read bound): what a TMA ring alone streams per SM
#    (`benchmarks/stream_probe.py`, new in session 28: one CTA per SM, boxes of 8-32 KB,
#    2-8 in flight, against a same-run copy). The megakernel's up task streams 16 KB per K
#    step on 5 stages and reached 13-18 GB/s per SM: if the ring alone does ~2x that at the
#    same size, the megakernel's own waits are the loss; if only larger boxes or more
#    stages reach the copy rate, its tasks should stream those.
timeout 200 python3 benchmarks/stream_probe.py --out $OUT/sp 2>&1 | $F | grep "^|\|copy" | tail -24
