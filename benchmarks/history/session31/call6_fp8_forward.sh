# Session 31, call 6: issue 13's fp8 forward at 7B and 30B on this session's code (the
# SmoothQuant default's vec changed to 4 at d = 4096, which the 30B X quantization uses).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 420 python3 benchmarks/quant.py --fp8 --shapes 7b,30b --out /tmp/f > $OUT/fp8.log 2>&1
cp /tmp/f/*RESULTS.md $OUT/ 2>/dev/null; grep "^|" $OUT/fp8.log | tail -8; tail -3 $OUT/fp8.log
