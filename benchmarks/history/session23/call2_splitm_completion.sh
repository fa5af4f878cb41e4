# Session 23, call 2 (H200): why split-M 128-row tiles with one N = 256 wgmma per consumer
# run their K loop at 547 us when their feed alone takes 398 (call 1, session 22 call 7).
# Hypothesis: the lagged cp.async publish (wait_group, the cooperative kernel's default)
# keeps only ~2 K steps in flight, and with the wgmmas holding two more slots the gather's
# latency shows; hardware-tracked stages (mbarrier) keep every free slot in flight.
# Controls: 3 stages (less in flight: slower if latency bounds it), half the weight bytes.
B=up_coop+block_m=128+fused+interleaved
M=gather_completion=mbarrier
K=$B+num_stages=4+noepilogue
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels \
$K,$K+$M,$B+num_stages=4+$M,$B+num_stages=3+noepilogue,$B+num_stages=3+noepilogue+$M,$K+halfweights,$K+$M+nomma,$K+nomma,up_pingpong+fused+interleaved,up_pingpong \
 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -14
