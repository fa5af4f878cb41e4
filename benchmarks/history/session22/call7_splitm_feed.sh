# Session 22, call 7 (H200): can 128-row items be fed faster than the MMA runs? The cooperative
# up-proj with split-M tiles (block_m=128: 2 consumers x 64 rows sharing one [64, 128] gate and
# up weight stage; 48 KB per 4.2-MFLOP step) with and without its epilogue and wgmmas.
B=up_coop+block_m=128+num_stages=4
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels $B,$B+noepilogue,$B+noepilogue+nomma,up_pingpong,up_pingpong+noepilogue+nomma 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -8
