# Session 23, call 10 (H200, the budget's last ~280 s): part of next_call_contention.sh, the
# cooperative up-proj (64 x 512 tiles, 72 KB per 4.2 MFLOP) and the persistent dH: K loop
# without epilogue, feed alone (nomma), MMA alone (nofeed).
U=up_coop+noepilogue
D=dh_noepilogue
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 170 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels \
$U,$U+nomma,$U+nofeed,$D,$D+nomma,$D+nofeed \
 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -10
