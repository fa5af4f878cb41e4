# Session 24, call 1: session 23's planned contention call (next_call_contention.sh), with the
# cp.async split-M rows of call 9 rerun in the same run so every comparison is same-machine.
# Does the feed/MMA contention of the gathering K loops follow the cp.async gather? Split-M
# fused tiles: cp.async rows (C), the TMA row loader from 1 (S) and 2 (S2) producer warpgroups;
# each as K loop / feed alone (nomma) / MMA alone (nofeed). Then the fused ping-pong's nofeed.
C=up_coop+block_m=128+fused+interleaved+num_stages=4+gather_completion=mbarrier+noepilogue
S=up_coop+block_m=128+fused+interleaved+num_stages=4+gather=tma+noepilogue
S2=$S+num_producers=2
F=up_pingpong+fused+interleaved+noepilogue
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 420 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels \
$C,$C+nomma,$C+nofeed,$S,$S+nomma,$S+nofeed,$S2,$S2+nomma,$S2+nofeed,$F,$F+nofeed \
 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -16
