# Session 22, call 6 (H200): the 7B step, same run, with the ping-pong up-proj's stages on
# mbarriers (the H200's default) against the lagged publish (`lagged-up`), top-K routing.
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/step.py --shapes 7b --variants topk/cp_async,topk/cp_async/lagged-up,topk/cp_async --out $OUT/step 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -5
