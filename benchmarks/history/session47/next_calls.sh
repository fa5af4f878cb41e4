# Session 47's plan for the next GPU session. Session 46's part S ran in session 47 (split-M
# dH: correct, slower, stays opt-in), so its part P (the step with split-M dH) is dropped.
# `bash benchmarks/history/session47/next_calls.sh PART` from the repo root; each part < 10 min,
# logs under $OUT; fire each call as the last returns (the machine goes back after 30 s idle).
# In this order: U on an H100 (the split-M up-proj at d = 2048 / 2880, the forward's bound
# ratios), G (dH's 30B-width configs test, the quant GPU tests), R (decode GPU tests), F (fp8
# GPU tests): session 45's parts, unchanged.
PART=${1:-U}
exec bash "$(dirname "$0")/../session45/next_calls.sh" "$PART"
