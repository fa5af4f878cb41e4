# Session 58's GPU calls: `bash benchmarks/history/session58/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   P (~9 min, H100): session 57's part P (the ping-pong dH: ptxas registers, paired
#      timings at 7B and 30B, GPU tests).
#   S (~9 min, H100): issue 9: the training step with the ping-pong dH (TMA stores and
#      register stores) against the default, 30B and 7B, 3 rounds paired.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-P}
case "$PART" in
S)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
  timeout 570 python3 benchmarks/step.py --shapes 30b,7b \
    --variants topk/cp_async,topk/cp_async/pingpong-dh,topk/cp_async/pingpong-dh-reg --rounds 3 \
    --out $OUT/step > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | tail -6
  grep "^|" $OUT/step.log | tail -10 ;;
*)
  bash benchmarks/history/session57/next_calls.sh "$PART" ;;
esac
echo "session 58 part $PART done in $(( $(date +%s) - T0 )) s"
