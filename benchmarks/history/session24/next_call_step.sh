# Planned for the next session (built in session 24, not run: device budget spent).
# 1. On an H200: the whole training step on the new up-proj default above d = 1536 (the
#    persistent split-M kernel) against the cooperative kernel it replaced, at 30B and the
#    Qwen3 widths (the kernel alone: 1.105x / 1.113x in session 24).
# 2. On an H100 (when lent): the same kernel against the H100's defaults (cooperative above
#    d = 1536, ping-pong at 7B), to decide its default there.
export PYTHONPATH=. PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 500 python3 benchmarks/step.py --out $OUT --shapes 30b,qwen3-30b-a3b \
    --variants topk/cp_async,topk/cp_async/cooperative-up 2>&1 | grep "^|" | tail -8
else
  timeout 250 python3 benchmarks/timeline.py --plain --out $OUT/t --shapes 7b,30b,qwen3-30b-a3b \
    --kernels up,up_pingpong+block_m=128+num_stages=4,up_pingpong+block_m=128+num_stages=4+gather_completion=wait_group \
    2>&1 | grep "^|"
  timeout 300 python3 benchmarks/step.py --out $OUT --shapes 7b,30b \
    --variants topk/cp_async,topk/cp_async/split-m-up 2>&1 | grep "^|" | tail -8
fi
