# Call 2: the up-proj's timeline with the SM clock and the between-CTA time fitted from the
# trace, and three epilogue ablations (timing only), 7B; the 30B up-proj again.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 330 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels up,up_nostore,up_nomath,up_noepilogue 2>&1 | grep -v "^WARNING\|warn" | grep "==\|CUPTI\|fit\|k_loop\|epilogue\|gap\|loads"
timeout 200 python3 benchmarks/timeline.py --out $OUT/30b --shapes 30b --kernels up 2>&1 | grep -v "^WARNING\|warn" | grep "==\|CUPTI\|fit\|k_loop\|epilogue\|gap\|loads"
