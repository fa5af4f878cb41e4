# Session 22, call 3: call 2 measured the ping-pong up-proj with hardware-tracked cp.async stages
# (gather_completion=mbarrier) at 552.0 against 592.2 us (lagged publish, the default). Repeat,
# interleaved, and the same switch for the persistent dH (default wait_group); skewed routing too.
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
M=gather_completion=mbarrier
timeout 400 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels up_pingpong,up_pingpong+$M,up_pingpong,up_pingpong+$M,dh,dh_$M,dh,dh_$M,up_pingpong+$M+num_stages=4,up_pingpong+$M+prefetch_steps=8,up_pingpong+$M+noepilogue,up_pingpong+$M+noepilogue+nomma 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -15
