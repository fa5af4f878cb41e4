# Session 21, call 6 (H100): the 7B step with both routings on the final defaults (dH
# persistent with the swizzled, cp.async-loaded epilogue).
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 170 python3 benchmarks/step.py --shapes 7b --variants topk/cp_async,token_rounding/cp_async --out $OUT/step 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -8
