# Session 34, call 1 (issue 17, nvidia-h200-x2): every EP = 2 correctness check of ep.py on
# the kernel path (both dispatches, none/chunked overlap, top-K and token rounding, random
# and skewed routing) plus the xla path under check_vma=True, in six processes that compile
# side by side and take the GPUs one at a time (--gpu-lock); beside them, the `small`
# training job on both GPUs with EP = 2 (ragged dispatch) and on one GPU, loss curves compared.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -5; nproc
EP="python3 benchmarks/ep.py --backend mosaic --ep 2 --skip-bench --gpu-lock /tmp/ep.lock"
check() { name=$1; shift; timeout 520 $EP "$@" --out /tmp/ep/$name.md > /tmp/ep/$name.log 2>&1; echo "$name rc=$?"; }
mkdir -p /tmp/ep
T0=$(date +%s)
check rn_topk --dispatch ragged_all_to_all --overlap none --check-routings topk &
check rn_tr --dispatch ragged_all_to_all --overlap none --check-routings token_rounding &
check rc_topk --dispatch ragged_all_to_all --overlap chunked --check-routings topk &
check rc_tr --dispatch ragged_all_to_all --overlap chunked --check-routings token_rounding &
check ag_topk --dispatch all_gather --overlap none --check-routings topk &
check ag_tr --dispatch all_gather --overlap none --check-routings token_rounding &
TRAIN="python3 -m train.main --config small --steps 60 --eval-every 20 --checkpoint-every 0 --no-progress"
( timeout 520 $TRAIN --out /tmp/ep/train_1gpu > /tmp/ep/train_1gpu.log 2>&1; echo "train_1gpu rc=$?" ) &
( timeout 520 $TRAIN --set devices=0 --set expert_parallel=2 --set dispatch=ragged_all_to_all \
    --out /tmp/ep/train_ep2 > /tmp/ep/train_ep2.log 2>&1; echo "train_ep2 rc=$?" ) &
wait
echo "all done in $(( $(date +%s) - T0 )) s"
grep -h "^check" /tmp/ep/*.log | grep -v cuda_event > $OUT/checks.log
python3 benchmarks/history/session34/compare_runs.py /tmp/ep/train_1gpu /tmp/ep/train_ep2 > $OUT/train_compare.txt 2>&1
tail -3 /tmp/ep/train_*.log
cat $OUT/train_compare.txt
tar czf $OUT/call1_logs.tar.gz /tmp/ep/*.log /tmp/ep/*.md /tmp/ep/*.json /tmp/ep/train_*/metrics.jsonl 2>/dev/null
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/checks.log"):
    c = json.loads(line[len("check "):])
    worst = max([c.get("y_rel_err", 1), c.get("dx_rel_err", 1), *c.get("dparams_rel_err", {}).values()]) if "error" not in c else None
    print(f"{c['dispatch']:18s} {c['overlap']:8s} {c['routing']:15s} skew={c['skew']!s:5s} {c['backend']:6s} vma={c['check_vma']!s:5s} "
          f"y={c.get('y_rel_err', float('nan')):.1e} dx={c.get('dx_rel_err', float('nan')):.1e} worst={worst} ok={c['ok']} {c.get('error', '')[:150]}")
PY
