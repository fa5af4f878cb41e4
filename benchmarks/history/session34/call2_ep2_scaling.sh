# Session 34, call 2 (issue 17, nvidia-h200-x2): strong scaling (30B layer, T = 32768 global)
# and weak scaling (4096 tokens per GPU), EP = 1 against EP = 2, all_gather / ragged none /
# ragged chunked (2 chunks; 4 chunks in a process of its own), forward and forward+backward
# wall time, each EP config's forward traced (collective GPU time and the part of it the
# layer's kernels hid), the link bandwidth. Beside them, the xla backend's EP checks with
# check_vma=True again (call 1: they failed on the GPU; fixed in pallas_moe/_vma.py).
# Processes compile side by side and time one at a time (--gpu-lock).
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/ep
EP="python3 benchmarks/ep.py --ep 2 --gpu-lock /tmp/ep.lock"
job() { name=$1; frac=$2; shift 2; XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 540 $EP "$@" --out /tmp/ep/$name.md > /tmp/ep/$name.log 2>&1; echo "$name rc=$?"; }
T0=$(date +%s)
job s_ag 0.14 --backend mosaic --skip-check --scaling strong --dispatch all_gather &
job s_ra 0.14 --backend mosaic --skip-check --scaling strong --dispatch ragged_all_to_all &
job s_ra4 0.14 --backend mosaic --skip-check --scaling strong --dispatch ragged_all_to_all --overlap chunked --num-chunks 4 &
job w_ag 0.14 --backend mosaic --skip-check --scaling weak --dispatch all_gather &
job w_ra 0.14 --backend mosaic --skip-check --scaling weak --dispatch ragged_all_to_all &
job x_ra 0.05 --backend xla --skip-bench --dispatch ragged_all_to_all &
job x_ag 0.05 --backend xla --skip-bench --dispatch all_gather &
wait
echo "all done in $(( $(date +%s) - T0 )) s"
grep -h "^link\|^bench\|^trace" /tmp/ep/[sw]_*.log > $OUT/bench.log
grep -h "^check" /tmp/ep/x_*.log > $OUT/checks_xla.log
for f in /tmp/ep/[sw]_*.md; do echo "## $f"; cat $f; done > $OUT/ep_tables.md
tar czf $OUT/call2_logs.tar.gz /tmp/ep/*.log /tmp/ep/*.json 2>/dev/null
grep -h "Error\|error" /tmp/ep/*.log | grep -v "^check\|^bench" | sort | uniq -c | head -20
cut -c1-200 $OUT/checks_xla.log
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/bench.log"):
    kind, _, body = line.partition(" ")
    r = json.loads(body)
    if kind == "bench":
        print("bench", r["scaling"], r["T"], r["ep"], r["dispatch"], r["overlap"],
              "fwd %.2f fb %.2f" % (r.get("fwd_ms", -1), r.get("fwd_bwd_ms", -1)), r.get("error", "")[:200])
    elif kind == "trace":
        print("trace", r["T"], r["ep"], r["dispatch"], r["overlap"], r["device"][-1],
              "coll %.0f us hidden %.0f us" % (r["collective_us"], r["hidden_us"]),
              [(n[:28], round(d), round(h)) for n, d, h in r["collectives"]][:10])
    else:
        print(line.strip())
PY
