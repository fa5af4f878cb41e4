# Session 48's GPU plan: `bash benchmarks/history/session48/next_calls.sh PART` from the repo
# root; each part < 10 min, logs under $OUT. Fire each call as the last returns (the machine
# goes back after 30 s idle).
#   P (an H100; on an H200 `auto` runs G): can the persistent up-proj be the only one
#     (issue 16, one kernel per op)? The default against split-M items (block_n 128, or 64
#     where 128 does not divide n) and the cooperative kernel, at the widths where the
#     cooperative kernel is still the default (d = 7168; gpt-oss's n = 2880) and where
#     split-M became the H100's default by analogy (d = 2048, 2880: session 45's part U).
#   then session 45's parts G, R, F (`session45/next_calls.sh`), and its U's second half
#     (the forward's bound ratios at 7B and 30B) as part B.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-P}
if [ "$PART" = auto ]; then
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then PART=P; else PART=G; fi
  echo "auto -> part $PART"
fi
case "$PART" in
P)
  timeout 540 python3 benchmarks/forward.py --shapes w7168,gpt-oss-20b,qwen3-30b-a3b,w2880 \
    --skew '' --up-sweep persistent --down-sweep none --no-baselines --rounds 3 \
    --out $OUT/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
  grep "^  up \|^==\|errors\|FAIL" $OUT/forward.log | sed 's/UpProjConfig(\(.\{0,120\}\).*/UpProjConfig(\1/' | cut -c1-230 ;;
B)
  timeout 560 python3 benchmarks/forward.py --shapes 7b,30b --skew '' --up-sweep none \
    --down-sweep none --out $OUT/fw2 > $OUT/forward2.log 2>&1
  echo "forward2 rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/forward2.log | cut -c1-260 | tail -8 ;;
*)
  exec bash "$(dirname "$0")/../session45/next_calls.sh" "$PART" ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
