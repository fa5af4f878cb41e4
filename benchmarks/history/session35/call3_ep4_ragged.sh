# Session 35, call 3 (issue 17, nvidia-h200-x4). Call 2's strong ragged process ran out of
# memory on one GPU at MEM_FRACTION 0.14 (the decomposer asked for a 15.8 GiB buffer) and its
# other rank hung in the collective holding the GPU lock (ep.py now has --turn-limit). So:
# fewer processes with more memory each: strong ragged none / chunked at EP = 2, 4 (comm_sms 0),
# strong chunked with 32 SMs left to the combine, weak at EP = 4, kernels' token rounding at EP = 4.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/ep
T0=$(date +%s)
EP="python3 benchmarks/ep.py --gpu-lock /tmp/ep.lock --turn-limit 150 --dispatch ragged_all_to_all --backend mosaic"
job() { name=$1; frac=$2; shift 2; XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout $((500 - $(date +%s) + T0)) $EP "$@" --out /tmp/ep/$name.md > /tmp/ep/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s) - T0 )) s"; }
job s_ra 0.3 --ep 2,4 --skip-check --scaling strong --iters 5 &
job s_c32 0.3 --ep 2,4 --skip-check --scaling strong --overlap chunked --comm-sms 32 --iters 5 &
job w_ra 0.15 --ep 4 --skip-check --scaling weak --iters 5 &
job c_m 0.04 --ep 4 --skip-bench --check-routings token_rounding &
wait
echo "all done in $(( $(date +%s) - T0 )) s"
grep -h "^check" /tmp/ep/c_*.log > $OUT/checks.log
grep "^link\|^bench\|^trace" /tmp/ep/[sw]_*.log | sed "s#/tmp/ep/##; s#\.log:# #" > $OUT/bench.log
for f in /tmp/ep/[sw]_*.md; do echo "## $f"; cat $f; done > $OUT/ep_tables.md 2>/dev/null
tar czf $OUT/logs.tar.gz /tmp/ep/*.log /tmp/ep/*.json 2>/dev/null
grep -h "Error\|error\|out of memory" /tmp/ep/*.log | grep -v "^check\|^bench\|^trace" | sort | uniq -c | head -10 | cut -c1-300
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
              [(n[:20], round(d), round(h)) for n, d, h in r["collectives"]][:10])
PY
