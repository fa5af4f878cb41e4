# Session 28, call 1: session 27's owed run, items 1-3 (benchmarks/history/session27/next_call_step.sh).
# 1. the op-level test on session 27's gather order; 2. the 7B and 30B step with its same-run
# bound; 3. the forward kernels against their same-run dense bounds.
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
date
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla" 2>&1 | tail -3
date
timeout 240 python3 benchmarks/step.py --out $OUT/step --shapes 7b,30b --variants topk/cp_async \
  2>&1 | $F | tee $OUT/step.log | grep "^|\|kernels" | tail -8
date
timeout 140 python3 benchmarks/forward.py --out $OUT/fwd --shapes 7b,30b 2>&1 | $F | tee $OUT/fwd.log | grep "^|" | tail -12
date
