# Session 33 call 1 (issue 15): session 32's prepared part B, the T = 1 and 8 variants
# without the gather hot spot, twice in opposite orders.
bash benchmarks/history/session32/next_call_h200.sh B
