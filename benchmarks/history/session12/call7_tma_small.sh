# Session 12, device call 7: the one-TMA-per-row loader against cp.async at the smallest T,
# on the 5-stage default (at 4 stages, call 2: 50.8 vs 60.2 us at T = 1).
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/decode
timeout 240 python3 benchmarks/decode.py --out $OUT/decode --tokens 1,2,4,8 --iters 50 \
  --variants static_tma,kernels,static > $OUT/decode_stdout.txt 2>&1; echo "decode rc $?"
sed -n '/MoE kernels alone/,+7p' $OUT/decode/decode_RESULTS.md
