# Session 12, device call 4: where the megakernel beats the kernel path at the smallest T
# (sets moe_forward.DECODE_MAX_TOKENS), the 5-stage default against 4, the GPU decode suite
# on the new defaults (5 stages, ex2.approx, moe_ffn's automatic megakernel), then the 30B
# step with the approx default.
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/decode
timeout 200 python3 benchmarks/decode.py --out $OUT/decode --tokens 1,2,4,8 \
  --variants kernels,auto,static_s4,static > $OUT/decode_stdout.txt 2>&1; echo "decode rc $?"
timeout 280 python3 -m pytest -p no:xdist -m gpu tests/test_gpu_decode.py -q -rA \
  > $OUT/gpu_decode.txt 2>&1; echo "test_gpu_decode rc $?"; tail -2 $OUT/gpu_decode.txt
timeout 100 python3 benchmarks/step.py --out $OUT/step30 --shapes 30b --variants topk/cp_async > $OUT/step_30b_approx.txt 2>&1; echo "step rc $?"
sed -n '/MoE kernels alone/,+8p' $OUT/decode/decode_RESULTS.md
tail -1 $OUT/step_30b_approx.txt
