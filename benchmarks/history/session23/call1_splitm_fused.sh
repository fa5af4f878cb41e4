# Session 23, call 1 (H200; built as session 22 call 9, which the budget did not reach): split-M 128-row tiles with one N = 256
# wgmma per consumer on interleaved W1 (call 7 found split-M's feed under the dense bound, call
# 8 that one N = 256 wgmma removes the MMA-side limit). Timing first, then the bitwise GPU test.
B=up_coop+block_m=128+num_stages=4
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 75 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels $B+fused+interleaved+noepilogue,$B+fused+interleaved,up_pingpong 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -6
PYTHONPATH=. timeout 100 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_up_proj_pingpong_equals_cooperative and shape0" 2>&1 | tail -3
