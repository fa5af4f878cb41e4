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
# 3. On either card: the persistent weight gradients with 4 stages beside one output buffer
#    per consumer (`WeightGradConfig.output_chunks=1`, built and interpret-checked in session
#    24, lowering checked at 7B/30B/Qwen3): bitwise against the default, XLA reference,
#    times against the default and the 3-stage persistent form; then the 7B step with it;
#    then its GPU test.
timeout 300 python3 benchmarks/history/session23/wg_persistent.py 7b,30b --output-chunks 2>&1 \
  | grep -v "^WARNING\|^I0000\|^W0000" | tail -14
timeout 200 python3 benchmarks/step.py --out $OUT/wg --shapes 7b \
  --variants topk/cp_async,topk/cp_async/persistent-wg4,topk/cp_async 2>&1 | grep "^|" | tail -5
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k test_weight_grad_persistent_equals_one_cta_per_item 2>&1 | tail -3
