# Session 23, call 9 (H200, the budget's last ~340 s): the MMA side alone (`nofeed`: no weight
# TMA, no gather loads; every stage still published and released) for the split-M fused tile
# (K loop 509 us, feed alone 385, call 2) and the ping-pong. If the MMA alone is also well
# under the K loop, the feed and the wgmmas contend for what they share (SMEM bandwidth).
B=up_coop+block_m=128+fused+interleaved+num_stages=4+gather_completion=mbarrier
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 150 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels \
$B+noepilogue,$B+noepilogue+nofeed,up_pingpong+noepilogue,up_pingpong+noepilogue+nofeed \
 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -8
