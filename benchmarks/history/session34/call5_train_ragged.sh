# Session 34, call 5 (issue 17, nvidia-h200-x2): `gpu_7b_layer` on both GPUs with EP = 2,
# the ragged dispatch (train.main now sets XLA's ragged_all_to_all decomposer flag itself)
# against the all_gather dispatch in the same call; losses against call 4's one-GPU run.
# Then, with the time left, issue 15's decode context (session 33's next_call A, T = 1).
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/ep
T0=$(date +%s)
TRAIN="python3 -m train.main --config gpu_7b_layer --steps 30 --eval-every 10 --checkpoint-every 0 --no-progress --set devices=0 --set expert_parallel=2"
timeout 160 $TRAIN --set dispatch=ragged_all_to_all --out /tmp/ep/t_ra > /tmp/ep/t_ra.log 2>&1; echo "t_ra rc=$? at $(( $(date +%s) - T0 )) s"
timeout 160 $TRAIN --set dispatch=all_gather --out /tmp/ep/t_ag > /tmp/ep/t_ag.log 2>&1; echo "t_ag rc=$? at $(( $(date +%s) - T0 )) s"
for r in t_ra t_ag; do grep "^done\|Error\|arning" /tmp/ep/$r.log | tail -3; done
python3 benchmarks/history/session34/compare_runs.py /tmp/ep/t_ag /tmp/ep/t_ra > $OUT/train_compare.txt 2>&1
cat $OUT/train_compare.txt
tar czf $OUT/call5_logs.tar.gz /tmp/ep/*.log /tmp/ep/t*/metrics.jsonl 2>/dev/null
LEFT=$((370 - $(date +%s) + T0))
echo "decode context with $LEFT s left"
[ $LEFT -gt 90 ] && timeout $LEFT python3 benchmarks/history/session33/decode_context.py --out $OUT --tokens 1 \
  2>&1 | grep -v cuda_event | tail -16
