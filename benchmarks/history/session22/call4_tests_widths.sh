# Session 22, call 4 (H200): the ping-pong up-proj with hardware-tracked stages as the H200's default:
# GPU tests through the op (both routings) and the ping-pong cases call 1 ran out of time for;
# then the ping-pong (H200 form) against the cooperative default at wider d.
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 230 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "(test_mosaic_matches_xla and (0-True-topk or 1-True-token_rounding)) or (test_up_proj_pingpong_equals_cooperative and (shape3 or shape4))" 2>&1 | tail -6 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
timeout 300 python3 benchmarks/timeline.py --plain --out $OUT --shapes qwen3-30b-a3b,w2880,30b --kernels up,up_pingpong,up_pingpong+gather_completion=wait_group 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -12
