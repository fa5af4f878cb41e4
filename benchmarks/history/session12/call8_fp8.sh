# Session 12, device call 8: the fp8 up-proj's SwiGLU with ex2.approx (GroupedMatmulConfig
# approx_math, default like the bf16 up-proj's): the fp8 GPU tests, then the 30B fp8 forward
# against bf16 (both with the approximate exp), issue 13's 1.5x target.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -p no:xdist -m gpu tests/test_quant_fp8.py -q -rA \
  > $OUT/gpu_fp8.txt 2>&1; echo "fp8 tests rc $?"; tail -2 $OUT/gpu_fp8.txt
mkdir -p $OUT/fp8
timeout 330 python3 benchmarks/quant.py --fp8 --shapes 30b --out $OUT/fp8 > $OUT/fp8_30b_stdout.txt 2>&1; echo "fp8 bench rc $?"
grep -A3 "^| shape" $OUT/fp8/fp8_RESULTS.md | head -4
