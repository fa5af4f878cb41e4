# Session 31, call 1: session 30's prepared part A (up-proj in the step's context; decode
# mbarrier GPU tests).
bash benchmarks/history/session30/next_call_h200.sh A
