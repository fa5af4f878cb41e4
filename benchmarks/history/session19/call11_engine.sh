# Call 11: the grouped-GEMM engine's timelines (down-proj, dX~), 7B.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels down,dx > $OUT/timeline_stdout.txt 2>&1
grep "==\|CUPTI\|consumer\|producer\|SM clock\|CTAs\|Error" $OUT/timeline_stdout.txt | cut -c1-180
grep -B2 -A5 "Error\|error:" $OUT/timeline_stdout.txt | head -20
