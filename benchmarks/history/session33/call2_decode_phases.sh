# Session 33 call 2 (issue 15): call 1 found no variant faster than the default at T = 1
# (lookahead, early weights, 6-7 stages all level or slower); the phase split of the fixed
# kernel (session 32's part D) says where its ~9 us above the bound go.
bash benchmarks/history/session32/next_call_h200.sh D
