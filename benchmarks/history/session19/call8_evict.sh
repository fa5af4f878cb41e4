# Call 8: the up-proj and dH with L2 evict_first stores (call 7: ptxas refused the policy's
# ".f32" type), 7B and 30B up-proj.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels up,up_evictfirst,dh,dh_evictfirst > $OUT/timeline_stdout.txt 2>&1
grep "==\|CUPTI\|consumer0 | k_loop\|consumer0 | epilogue_store\|consumer0 | store\|consumer0 | h_load\|fit\|Error" $OUT/timeline_stdout.txt
grep -A6 "error:" $OUT/timeline_stdout.txt | head -12
timeout 200 python3 benchmarks/timeline.py --out $OUT/30b --shapes 30b --kernels up,up_evictfirst 2>&1 | grep "==\|CUPTI\|consumer0 | k_loop\|fit\|Error"
