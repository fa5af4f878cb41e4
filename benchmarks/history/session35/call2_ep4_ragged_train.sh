# Session 35, call 2 (issue 17, nvidia-h200-x4). Call 1's ragged rows ran XLA's slow default
# collective (a module import had started JAX before ep.py set the decomposer flag; fixed).
# 1. Training parity, 150 steps of gpu_7b_layer, holding the GPU lock: one GPU twice (GPUs 2
#    and 3: the run-to-run spread) and EP = 2 all_gather (GPUs 0, 1), side by side.
# 2. Then, processes compiled meanwhile: the ragged dispatch's strong and weak scaling at
#    EP = 2, 4 (none, chunked) and the chunked forward with 16 / 32 SMs left to the combine,
#    with the decomposer; the checks session 34 left (xla check_vma ragged chunked token
#    rounding; the kernels' token rounding under the flag).
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/ep
T0=$(date +%s)
TRAIN="python3 -m train.main --config gpu_7b_layer --steps 150 --eval-every 25 --checkpoint-every 0 --no-progress"
(
  flock 9
  ( CUDA_VISIBLE_DEVICES=2 timeout 300 $TRAIN --out /tmp/ep/t1a > /tmp/ep/t1a.log 2>&1; echo "t1a rc=$?" ) &
  ( CUDA_VISIBLE_DEVICES=3 timeout 300 $TRAIN --out /tmp/ep/t1b > /tmp/ep/t1b.log 2>&1; echo "t1b rc=$?" ) &
  ( CUDA_VISIBLE_DEVICES=0,1 timeout 300 $TRAIN --set devices=0 --set expert_parallel=2 --set dispatch=all_gather \
      --out /tmp/ep/t2 > /tmp/ep/t2.log 2>&1; echo "t2 rc=$?" ) &
  wait
  echo "training done at $(( $(date +%s) - T0 )) s"
) 9>/tmp/ep.lock &
sleep 2
EP="python3 benchmarks/ep.py --ep 2,4 --gpu-lock /tmp/ep.lock --dispatch ragged_all_to_all"
job() { name=$1; frac=$2; shift 2; XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout $((570 - $(date +%s) + T0)) $EP "$@" --out /tmp/ep/$name.md > /tmp/ep/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s) - T0 )) s"; }
job s_ra 0.14 --backend mosaic --skip-check --scaling strong --iters 5 &
job s_c16 0.14 --backend mosaic --skip-check --scaling strong --overlap chunked --comm-sms 16 --iters 5 &
job s_c32 0.14 --backend mosaic --skip-check --scaling strong --overlap chunked --comm-sms 32 --iters 5 &
job w_ra 0.07 --backend mosaic --skip-check --scaling weak --iters 5 &
job c_x 0.03 --backend xla --skip-bench --overlap chunked --check-routings token_rounding &
job c_m 0.03 --backend mosaic --skip-bench --check-routings token_rounding &
wait
echo "all done in $(( $(date +%s) - T0 )) s"
for r in t1a t1b t2; do grep "^done\|Error" /tmp/ep/$r.log | tail -1; done
python3 benchmarks/history/session34/compare_runs.py /tmp/ep/t1a /tmp/ep/t1b > $OUT/train_compare.txt 2>&1
python3 benchmarks/history/session34/compare_runs.py /tmp/ep/t1a /tmp/ep/t2 >> $OUT/train_compare.txt 2>&1
python3 benchmarks/history/session34/compare_runs.py /tmp/ep/t1b /tmp/ep/t2 >> $OUT/train_compare.txt 2>&1
grep -h "^check" /tmp/ep/c_*.log > $OUT/checks.log
grep "^link\|^bench\|^trace" /tmp/ep/[sw]_*.log | sed "s#/tmp/ep/##; s#\.log:# #" > $OUT/bench.log
for f in /tmp/ep/[sw]_*.md; do echo "## $f"; cat $f; done > $OUT/ep_tables.md 2>/dev/null
tar czf $OUT/logs.tar.gz /tmp/ep/*.log /tmp/ep/*.json /tmp/ep/t*/metrics.jsonl 2>/dev/null
grep -h "Error\|error" /tmp/ep/*.log | grep -v "^check\|^bench\|^trace" | sort | uniq -c | head -10 | cut -c1-300
grep -E "val|tokens_per_s" $OUT/train_compare.txt | cut -c1-200
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/checks.log"):
    c = json.loads(line[len("check "):])
    worst = max([c.get("y_rel_err", 1), c.get("dx_rel_err", 1), *c.get("dparams_rel_err", {}).values()]) if "error" not in c else None
    print(f"EP{c['ep']} {c['backend']} vma={c['check_vma']} {c['dispatch']:18s} {c['overlap']:8s} {c['routing']:15s} skew={c['skew']!s:5s} worst={worst} ok={c['ok']} {c.get('error', '')[:120]}")
for line in open(os.environ["OUT"] + "/bench.log"):
    job, kind, body = line.split(" ", 2)
    r = json.loads(body)
    if kind == "bench":
        print(job, "bench", r["scaling"], r["T"], r["ep"], r["dispatch"], r["overlap"],
              "fwd %.2f fb %.2f" % (r.get("fwd_ms", -1), r.get("fwd_bwd_ms", -1)), r.get("error", "")[:150])
    elif kind == "trace" and r["device"].endswith("0"):
        print(job, "trace", r["T"], r["ep"], r["overlap"], "coll %.0f us hidden %.0f us" % (r["collective_us"], r["hidden_us"]),
              [(n[:20], round(d), round(h)) for n, d, h in r["collectives"]][:8])
PY
