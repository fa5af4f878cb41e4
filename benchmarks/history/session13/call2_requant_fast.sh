# Session 13, device call 2: issue 13's A re-quantization. The row-block kernel against the
# CSR SmoothQuant kernel (bitwise, poisoned outputs, then CUPTI time vs a device copy), its
# GPU tests, then the 30B fp8 forward against bf16 (the 1.5x target).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/history/session13/requant_ab.py 7b,30b > $OUT/requant_ab.txt 2>&1; echo "ab rc $?"
timeout 120 python3 -m pytest -p no:xdist -m gpu tests/test_quant.py -k row_blocks -q -rA > $OUT/gpu_row_blocks.txt 2>&1; echo "tests rc $?"; tail -2 $OUT/gpu_row_blocks.txt
mkdir -p $OUT/fp8
timeout 250 python3 benchmarks/quant.py --fp8 --shapes 30b --out $OUT/fp8 > $OUT/fp8_30b_stdout.txt 2>&1; echo "fp8 bench rc $?"
grep -A3 "^| shape" $OUT/fp8/fp8_RESULTS.md | head -4
sed -n '/^| shape | smoothed/,$p' $OUT/requant_ab.txt
