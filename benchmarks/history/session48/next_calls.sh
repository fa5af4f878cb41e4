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
# Ran in session 48: P and G (calls 1, 2), F and R (calls 3, 4). For the next GPU session,
# in this order:
#   N (any card): gpt-oss-20b's backward with `--sweep narrow` (both weight gradients with
#     three consumers; dH's forms again), then dH's GPU bitwise test at gpt-oss widths
#     (three consumers against one and the other configs).
#   S (an H100): the gpt-oss step with the new dH against one consumer (paired), then 7B
#     and 30B on today's defaults (nothing at their widths changed since session 45).
#   B: the forward's bound ratios at 7B and 30B with ragged_dot_mgpu (issue 16's table).
#   O: gpt-oss's down-proj against 64-row ping-pong items 192 wide (d = 2880: 128 does not
#     divide it; the default runs at 0.73 of the bound), and its up-proj's 64-column split-M
#     items with one N = 128 wgmma per K step on interleaved W1 (`fused_gate_up`) against
#     two of N = 64 (the default: 0.50 of the bound). If fused wins by much, storing W1
#     interleaved (a module / op layout decision) is what would buy it.
case "$PART" in
O)
  timeout 400 python3 benchmarks/forward.py --shapes gpt-oss-20b --skew '' --up-sweep persistent \
    --down-sweep default --no-baselines --rounds 3 --out $OUT/fw_oss > $OUT/fw_oss.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
  grep "^  up \|^  down \|^==\|errors" $OUT/fw_oss.log | cut -c1-230 ;;
N)
  timeout 330 python3 benchmarks/backward.py --shapes gpt-oss-20b --sweep narrow --rounds 3 \
    --out $OUT/bw > $OUT/bw.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
  grep "  dH \|  dW\|^|" $OUT/bw.log | cut -c1-260
  timeout 220 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "dh_configs_write_the_same_bits and gpt_oss" > $OUT/gpu_dh.log 2>&1
  echo "gpu dH rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_dh.log ;;
S)
  timeout 300 python3 benchmarks/step.py --shapes gpt-oss-20b --gpt-oss \
    --variants topk/cp_async,topk/cp_async/one-consumer-dh --rounds 3 --out $OUT/step_oss \
    > $OUT/step_oss.log 2>&1
  echo "step gpt-oss rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step_oss.log | tail -4
  timeout 260 python3 benchmarks/step.py --shapes 7b,30b --variants topk/cp_async --rounds 3 \
    --out $OUT/step > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step.log | tail -4 ;;
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
