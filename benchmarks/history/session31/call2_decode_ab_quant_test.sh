# Session 31, call 2: session 30's prepared part B (decode mbarrier A/B; SmoothQuant
# one_barrier GPU test).
bash benchmarks/history/session30/next_call_h200.sh B
