# Session 12, device call 6: pm.moe_ffn not differentiated now skips H (inference=True):
# `kernels` (explicit config) and `auto` against `kernels_inf` (moe_forward, no H) and the
# megakernel, every output against xla on poisoned buffers.
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/decode
timeout 300 python3 benchmarks/decode.py --out $OUT/decode --tokens 1,8,128,1024,4096 \
  --variants kernels,kernels_inf,auto,static > $OUT/decode_stdout.txt 2>&1; echo "decode rc $?"
sed -n '/MoE kernels alone/,+8p' $OUT/decode/decode_RESULTS.md
grep -A6 "^Correctness" $OUT/decode/decode_RESULTS.md
