# Planned for the first session that is lent an H100 (none since session 21). Issue 9's
# target is on the H100: the whole step <= 3.0 ms at 7B and <= 15.6 ms at 30B (SonicMoE 3.30 /
# 17.2 ms on the same kind). Sessions 22-28 tuned the H200's defaults; the H100 keeps its
# session-21 choices until measured. One run, the H100's defaults against the H200's choices
# (`step.py` CONFIG_FLAGS), both routings at 7B, top-K at 30B.
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
timeout 420 python3 benchmarks/step.py --out $OUT/step --shapes 7b,30b --variants \
  topk/cp_async,token_rounding/cp_async,topk/cp_async/mbarrier-up,topk/cp_async/persistent-wg4,topk/cp_async/split-m-up \
  2>&1 | $F | tee $OUT/step.log | grep "^|" | tail -12
# Then: make the winners the H100's defaults (`ForwardConfig.for_shape`,
# `BackwardConfig.for_shape`, keyed on device_kind), rerun the GPU suite
# (`pytest -m gpu tests/test_gpu.py`), and update the README's H100 table.
# Issue 13's 0.8 of copy is an H100 figure too: the SmoothQuant CSR kernel was 0.72-0.75 of
# the H100's copy in session 18 and has since run 1.3-1.5x faster on the H200 (0.74-0.78 of
# the H200's higher copy bandwidth); a latency-bound kernel should come closer to the
# H100's. Same-run copy, 7B / 30B / Qwen3 widths, both dtypes.
timeout 200 python3 benchmarks/quant.py --out $OUT/quant --shapes 7b,30b,d2048 --token-rounding "" \
  2>&1 | $F | tee $OUT/quant.log | grep "^|" | tail -12
