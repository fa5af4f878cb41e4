# Session 46's plan for the next GPU session (no GPU was lent in session 46):
# `bash benchmarks/history/session46/next_calls.sh PART` from the repo root; each part < 10 min,
# logs under $OUT. A fresh machine compiles every kernel (~40 s per GPU test), so the test
# parts are narrow. Fire each call as the last returns (the machine goes back after 30 s idle).
# In this order:
#   S (any card, first): dH's split-M items (session 46, opt-in): ptxas's registers and
#   spills, the GPU bitwise test at 7B and 30B widths, then the backward sweep at 7B and 30B;
#   then P (the whole step at 7B and 30B with split-M dH, `step.py ... split-m-dh`, paired);
#   adopt split-M in `BackwardConfig.for_shape` where it wins by more than its spread;
#   then session 45's plan: U on an H100 (the split-M up-proj at the widths session 45 adopted
#   it for by analogy, and the forward's bound ratios), G (dH's 30B-width bitwise test, the
#   quant GPU tests), R (the decode GPU tests), F (the fp8 GPU tests).
PART=${1:-S}
if [ "$PART" = P ]; then  # after S: the whole step with split-M dH, paired
  export PYTHONPATH=. PYTHONUNBUFFERED=1
  timeout 560 python3 benchmarks/step.py --shapes 7b,30b --rounds 3 \
    --variants topk/cp_async,topk/cp_async/split-m-dh --out $OUT/step > $OUT/step.log 2>&1
  echo "step rc=$?"; grep "^|" $OUT/step.log | cut -c1-220 | tail -8
  exit 0
fi
if [ "$PART" != S ]; then  # session 45's parts (U, G, F, R, auto), unchanged
  exec bash "$(dirname "$0")/../session45/next_calls.sh" "$PART"
fi
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
# Issue 9: dH split-M (`DHConfig.split_m`). First ptxas's verdict on the [64, 256] f32
# accumulator beside the dSwiGLU chunk (the removed ping-pong dH spilled), from the lowering
# the GPU test compiles; then the bitwise test (a hang shows up as the timeout here, before
# the benchmark); then the sweep, paired over 3 rounds.
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/ptxas timeout 230 python3 -m pytest \
  -p no:xdist -q -m gpu tests/test_gpu.py -k "dh_split_m_writes and (7b_widths or 30b_widths)" \
  > $OUT/gpu_split.log 2>&1
echo "gpu split rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_split.log
grep -rh "moe_dh\|Used [0-9]* registers\|spill" $OUT/ptxas 2>/dev/null | sort | uniq -c | head -20
if grep -q " passed" $OUT/gpu_split.log && ! grep -q "failed" $OUT/gpu_split.log; then
  timeout 330 python3 benchmarks/backward.py --shapes 7b,30b --sweep splitm --rounds 3 \
    --out $OUT/bw > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
  grep "dH\|^|" $OUT/backward.log | cut -c1-220 | tail -24
fi
echo "done in $(( $(date +%s) - T0 )) s"
