# Session 30, call 5: the split-M / ping-pong up-proj on forward.py's and step.py's plans,
# alone, same process (call 4's step disagreed with forward.py's ranking).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python3 benchmarks/history/session30/up_plans.py 2>&1 | tee $OUT/up_plans.log | grep "^|"
