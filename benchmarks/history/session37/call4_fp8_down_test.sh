# Session 37, call 4 (nvidia-h200): the fp8 ping-pong down-proj's new default (one output
# slab staged at a time; calls 1 and 3: 30B 1.011-1.012x, bitwise) against the model of
# the fp8 sums and bitwise the whole-tile split-M schedule, poisoned outputs.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant_fp8.py -k "test_fp8_pingpong_down_on_gpu" 2>&1 | tail -3
