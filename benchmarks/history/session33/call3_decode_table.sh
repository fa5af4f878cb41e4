# Session 33 call 3 (issue 15): the decode table on the fixed kernel (session 32's part C):
# kernel path, both schedulers, the unfused control and the op's choice at T = 1-1024; sets
# `H200_DECODE_MAX_TOKENS` if the megakernel now wins at T = 16 or 32.
bash benchmarks/history/session32/next_call_h200.sh C
