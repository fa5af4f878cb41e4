# Session 20, call 7: the 7B step with token rounding on the new default.
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 200 python3 benchmarks/step.py --shapes 7b --variants token_rounding/cp_async,topk/cp_async --out $OUT/step 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -8
