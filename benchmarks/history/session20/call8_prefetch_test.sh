# Session 20, call 8: the GPU test of the ping-pong up-proj with the L2 prefetch.
PYTHONPATH=. timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "pingpong_equals_cooperative and shape4" 2>&1 | tail -3
