# Session 22, call 5 (H200): the forward at 7B on the H200's default (ping-pong up-proj, stages on
# mbarriers) against the lagged publish, the dense bound and ragged_dot_mgpu in one run; then the
# 7B layer step, both routings (the step's A/B of the up-proj completion via step.py variants is
# not wired, so the up-proj's share is read from forward.py's same-run figures).
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 280 python3 benchmarks/forward.py --out $OUT --shapes 7b --up-sweep completion --down-sweep none --skew "" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -22
timeout 200 python3 benchmarks/step.py --shapes 7b --variants topk/cp_async,token_rounding/cp_async --out $OUT/step 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -8
