# Planned first call of the next session (built in session 23, not run): does the feed/MMA
# contention that bounds the ping-pong and split-M up-proj K loops (session 23, call 9) follow
# the cp.async gather? The same three ablations (K loop without epilogue, feed alone `nomma`,
# MMA alone `nofeed`) for the cooperative up-proj (64 x 512 tiles, 72 KB per 4.2 MFLOP), the
# fused ping-pong, and the persistent dH (whose K loops session 14 saw near the dense rate);
# then the cooperative kernel with the TMA row loader (no cp.async; its issue rate bounds the
# feed, so compare the K loop with the max of its two halves, not with the bound).
U=up_coop+noepilogue
F=up_pingpong+fused+interleaved+noepilogue
D=dh_noepilogue
T=up_coop+noepilogue+gather=tma
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels \
$U,$U+nomma,$U+nofeed,$F,$F+nofeed,$D,$D+nomma,$D+nofeed,$T,$T+nomma,$T+nofeed \
 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -16
