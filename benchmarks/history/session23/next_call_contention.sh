# Planned first call of the next session (built in session 23; its cooperative and dH rows ran
# as call 11). Does the feed/MMA contention that bounds the gathering kernels' K loops
# (session 23, calls 9 and 11: each half alone under the dense bound, together 1.23-1.5x the
# slower half) follow the cp.async gather? The split-M fused tile with the TMA row loader
# (one [1, 64] TMA per row, no cp.async) from 1 and 2 producer warpgroups (2: 16 row copies per
# warp per step, ~45 cycles each), each as K loop / feed alone (nomma) / MMA alone (nofeed);
# the cp.async split-M rows of call 9 are the comparison (524.7 / 384.8 / 394.0 us). If the TMA
# loader's K loop sits near the max of its halves, the contention is the cp.async path, and a
# TMA-issued gather with more issuing warps is the build; then the fused ping-pong's nofeed.
S=up_coop+block_m=128+fused+interleaved+num_stages=4+gather=tma+noepilogue
S2=$S+num_producers=2
F=up_pingpong+fused+interleaved+noepilogue
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels \
$S,$S+nomma,$S+nofeed,$S2,$S2+nomma,$F,$F+nofeed \
 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -12
