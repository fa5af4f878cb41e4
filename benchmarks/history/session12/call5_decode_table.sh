# Session 12, device call 5: the new GPU test of moe_ffn's automatic megakernel (forward and
# gradients against xla at T = DECODE_MAX_TOKENS), then the decode table on the new defaults.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -p no:xdist -m gpu tests/test_gpu_decode.py -q -rA \
  -k smallest_batches > $OUT/gpu_decode_auto.txt 2>&1; echo "test rc $?"; tail -2 $OUT/gpu_decode_auto.txt
mkdir -p $OUT/decode
timeout 270 python3 benchmarks/decode.py --out $OUT/decode --tokens 1,8,64,128,512,1024,4096 \
  --variants kernels,static,dynamic,unfused > $OUT/decode_stdout.txt 2>&1; echo "decode rc $?"
sed -n '/MoE kernels alone/,+10p' $OUT/decode/decode_RESULTS.md
