# Session 31, call 3: session 30's prepared part D (SmoothQuant row_reduction A/B at 7B, 30B).
bash benchmarks/history/session30/next_call_h200.sh D
