# Session 12, device call 3: the decode table again with the ring depths in a different
# order (s5 first), all T; then the 7B step with the approx default against --exact-math.
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/decode
timeout 330 python3 benchmarks/decode.py --out $OUT/decode --tokens 1,8,64,128,512,1024,4096 \
  --variants static_s5,kernels,static,static_s6 > $OUT/decode_stdout.txt 2>&1; echo "decode rc $?"
mkdir -p $OUT/step_approx $OUT/step_exact
timeout 110 python3 benchmarks/step.py --out $OUT/step_approx --shapes 7b --variants topk/cp_async > $OUT/step_approx.txt 2>&1; echo "step approx rc $?"
timeout 110 python3 benchmarks/step.py --out $OUT/step_exact --shapes 7b --variants topk/cp_async --exact-math > $OUT/step_exact.txt 2>&1; echo "step exact rc $?"
sed -n '/MoE kernels alone/,/^$/p;/MoE kernels alone/,+12p' $OUT/decode/decode_RESULTS.md | head -14
tail -2 $OUT/step_approx.txt; tail -2 $OUT/step_exact.txt
