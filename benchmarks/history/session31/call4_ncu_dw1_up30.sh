# Session 31, call 4: session 30's prepared part C (ncu raw pages: dW1 at 7B/30B, the 30B
# up-proj; L2 read sharing summed by benchmarks/ncu_l2.py).
bash benchmarks/history/session30/next_call_h200.sh C
