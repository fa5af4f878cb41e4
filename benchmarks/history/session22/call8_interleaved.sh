# Session 22, call 8 (H200): the MMA side of the ping-pong up-proj's K loop. With W1's gate and
# up columns interleaved per 128 (`gate_up_blocks=128`), a fused item's weights are one
# [64, 256] TMA box per K step and one N = 256 wgmma consumes them (no extra TMAs: call 1's
# confound). Bitwise GPU check first (shape0: 7B-like widths, 5 stages), then the timing.
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_up_proj_pingpong_equals_cooperative and shape0" 2>&1 | tail -3
P=up_pingpong
F=up_pingpong+fused+interleaved
timeout 200 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels $P,$F,$P+interleaved,$P+noepilogue,$F+noepilogue,$F+noepilogue+nomma,$P,$F 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -11
