# Call 6: issue 13's int8 XLA steps, H100 against CPU, stage by stage; then the up-proj and
# dH with an L2 evict_first policy on their output stores (timeline.py *_evictfirst).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/history/session19/int8_xla_stages.py > $OUT/int8_xla_stages.txt 2>&1
grep -v "^WARNING\|warn" $OUT/int8_xla_stages.txt | tail -9
timeout 300 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels up,up_evictfirst,dh,dh_evictfirst 2>&1 | grep "==\|CUPTI\|consumer0 | k_loop\|consumer0 | epilogue_store\|consumer0 | store\|consumer0 | h_load\|fit\|Error"
timeout 150 python3 benchmarks/timeline.py --out $OUT/30b --shapes 30b --kernels up,up_evictfirst 2>&1 | grep "==\|CUPTI\|consumer0 | k_loop\|consumer0 | epilogue_store\|fit\|Error"
