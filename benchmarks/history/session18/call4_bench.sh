# Call 4: the SmoothQuant op benchmark at every width (benchmarks/quant.py, after the gathered
# kernel's removal) and the fp8 forward (benchmarks/quant.py --fp8) with this session's kernel.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/quant $OUT/fp8
timeout 260 python3 benchmarks/quant.py --out $OUT/quant --shapes 7b,30b,d2048,d7168 2>&1 | grep -v "^I0000\|^W0000" | tail -40 > $OUT/quant_stdout.txt
timeout 300 python3 benchmarks/quant.py --fp8 --out $OUT/fp8 --shapes 7b,30b 2>&1 | grep -v "^I0000\|^W0000" | tail -40 > $OUT/fp8_stdout.txt
tail -22 $OUT/quant_stdout.txt; tail -22 $OUT/fp8_stdout.txt; ls $OUT/quant $OUT/fp8
