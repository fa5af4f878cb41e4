# Session 35, call 1 (issue 17, nvidia-h200-x4): session 34's part X plus the overlap A/B.
# Every correctness check at EP = 2 and 4 (both dispatches, none / chunked, top-K and token
# rounding, random and skewed), strong (T = 32768) and weak (4096 per GPU) scaling of the
# 30B layer at EP = 1, 2, 4, and the chunked ragged forward with 0 / 16 / 32 SMs left to the
# combine (ExpertParallel.comm_sms), each with its traced timeline. Prediction (session 34):
# with free SMs chunk 0's combine is >= 50% hidden and chunked beats "none".
# Processes compile side by side and take the GPUs one at a time (--gpu-lock).
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -6; nproc
mkdir -p /tmp/ep
T0=$(date +%s)
EP="python3 benchmarks/ep.py --ep 2,4 --gpu-lock /tmp/ep.lock --backend mosaic"
job() { name=$1; frac=$2; shift 2; XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 545 $EP "$@" --out /tmp/ep/$name.md > /tmp/ep/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s) - T0 )) s"; }
job c_ag 0.04 --skip-bench --dispatch all_gather &
job c_ra 0.04 --skip-bench --dispatch ragged_all_to_all --check-routings topk &
job c_rt 0.04 --skip-bench --dispatch ragged_all_to_all --check-routings token_rounding &
job s_ag 0.145 --skip-check --scaling strong --dispatch all_gather --iters 5 &
job s_ra 0.145 --skip-check --scaling strong --dispatch ragged_all_to_all --iters 5 &
job s_c16 0.145 --skip-check --scaling strong --dispatch ragged_all_to_all --overlap chunked --comm-sms 16 --iters 5 &
job s_c32 0.145 --skip-check --scaling strong --dispatch ragged_all_to_all --overlap chunked --comm-sms 32 --iters 5 &
job w_ag 0.07 --skip-check --scaling weak --dispatch all_gather --iters 5 &
job w_ra 0.07 --skip-check --scaling weak --dispatch ragged_all_to_all --iters 5 &
wait
echo "all done in $(( $(date +%s) - T0 )) s"
grep -h "^check" /tmp/ep/c_*.log > $OUT/checks.log
grep "^link\|^bench\|^trace" /tmp/ep/[sw]_*.log | sed "s#/tmp/ep/##; s#\.log:# #" > $OUT/bench.log
for f in /tmp/ep/[sw]_*.md; do echo "## $f"; cat $f; done > $OUT/ep_tables.md 2>/dev/null
tar czf $OUT/logs.tar.gz /tmp/ep/*.log /tmp/ep/*.json 2>/dev/null
grep -h "Error\|error" /tmp/ep/*.log | grep -v "^check\|^bench\|^trace" | sort | uniq -c | head -20
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/checks.log"):
    c = json.loads(line[len("check "):])
    worst = max([c.get("y_rel_err", 1), c.get("dx_rel_err", 1), *c.get("dparams_rel_err", {}).values()]) if "error" not in c else None
    print(f"EP{c['ep']} {c['dispatch']:18s} {c['overlap']:8s} {c['routing']:15s} skew={c['skew']!s:5s} worst={worst} ok={c['ok']} {c.get('error', '')[:120]}")
for line in open(os.environ["OUT"] + "/bench.log"):
    job, kind, body = line.split(" ", 2)
    r = json.loads(body)
    if kind == "bench":
        print(job, "bench", r["scaling"], r["T"], r["ep"], r["dispatch"], r["overlap"], r.get("comm_sms", ""),
              "fwd %.2f fb %.2f" % (r.get("fwd_ms", -1), r.get("fwd_bwd_ms", -1)), r.get("error", "")[:150])
    elif kind == "trace":
        print(job, "trace", r["T"], r["ep"], r["dispatch"], r["overlap"], r["device"][-1],
              "coll %.0f us hidden %.0f us" % (r["collective_us"], r["hidden_us"]),
              [(n[:24], round(d), round(h)) for n, d, h in r["collectives"]][:8])
    else:
        print(job, kind, body.strip()[:200])
PY
