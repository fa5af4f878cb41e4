# Session 23, call 8 (H200): the persistent weight gradients inside the step where experts
# hold fewer rows (call 5: 1.07x / 1.05x for dW1 / dW2 at half the 7B tokens): Qwen3-30B-A3B
# widths at 16384 tokens and d = 2880 at 8192 (1024 rows per expert each).
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 330 python3 benchmarks/step.py --out $OUT --shapes qwen3-30b-a3b,w2880 --variants topk/cp_async,topk/cp_async/persistent-wg,topk/cp_async 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -12
