# Call 5: the same-run A/B of the persistent dH's epilogue tiles (call 4's script failed on
# loading the old module), then the tiled kernel's timeline again.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python3 benchmarks/history/session19/dh_tiles_ab.py 7b,30b 2>&1 | grep "^|\|Error\|error" > $OUT/dh_tiles_ab.txt
cat $OUT/dh_tiles_ab.txt
timeout 120 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels dh 2>&1 | grep "==\|CUPTI\|consumer0"
