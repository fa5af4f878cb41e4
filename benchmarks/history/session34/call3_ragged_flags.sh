# Session 34, call 3 (issue 17, nvidia-h200-x2). Call 2 found XLA's ragged_all_to_all on
# GPU (its default one-shot kernel, "stream_executor::gpu::RaggedAllToAll...") taking
# 48-60 ms per collective for 268 MB (weak scaling, T_l*K = 32768 rows of d = 4096):
# ~5 GB/s. Stage 1 times the collective alone under four XLA settings (one process each,
# flags are read at backend start; --gpu-lock runs them one at a time). Stage 2 takes the
# fastest at the strong scaling's 131072 rows and runs, under it: strong and weak scaling of
# the ragged dispatch (none, chunked; the aggregation kernel's grid fix at 262144 rows), the
# ragged kernel-path checks (top-K, random and skewed) and the xla checks with check_vma.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/ep
T0=$(date +%s)
V0=""
V1="--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false"
V2="--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"
V3="--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true --xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false"
i=0
for v in "$V0" "$V1" "$V2" "$V3"; do
  ( XLA_FLAGS="$v" timeout 150 python3 benchmarks/ep.py --ep 2 --exchange-rows 32768,131072 --gpu-lock /tmp/ep.lock \
      > /tmp/ep/xchg_$i.log 2>&1; echo "variant $i rc=$?" ) &
  i=$((i+1))
done
wait
grep -h "^exchange" /tmp/ep/xchg_*.log > $OUT/exchange.log
python3 - <<'PY' > /tmp/ep/best_flags
import json, os
best = None
for line in open(os.environ["OUT"] + "/exchange.log"):
    r = json.loads(line[len("exchange "):])
    print(f"{r['xla_flags'] or '(default)':120s} rows {r['rows']:7d} ragged {r.get('ragged_all_to_all_ms', float('nan')):8.3f} ms "
          f"all_to_all {r.get('all_to_all_ms', float('nan')):7.3f} ms {r.get('ragged_all_to_all_error', '')[:120]}", file=__import__('sys').stderr)
    if r["rows"] == 131072 and "ragged_all_to_all_ms" in r and (best is None or r["ragged_all_to_all_ms"] < best[0]):
        best = (r["ragged_all_to_all_ms"], r["xla_flags"])
print(best[1] if best else "")
PY
export XLA_FLAGS="$(cat /tmp/ep/best_flags)"
echo "stage 1 done in $(( $(date +%s) - T0 )) s; best XLA_FLAGS='$XLA_FLAGS'"
EP="python3 benchmarks/ep.py --ep 2 --gpu-lock /tmp/ep.lock --dispatch ragged_all_to_all"
job() { name=$1; frac=$2; shift 2; XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout $((560 - $(date +%s) + T0)) $EP "$@" --out /tmp/ep/$name.md > /tmp/ep/$name.log 2>&1; echo "$name rc=$?"; }
job s_ra 0.3 --backend mosaic --skip-check --scaling strong &
job w_ra 0.3 --backend mosaic --skip-check --scaling weak &
job m_chk 0.1 --backend mosaic --skip-bench --check-routings topk --overlap none,chunked &
job x_chk 0.05 --backend xla --skip-bench --overlap none &
wait
echo "all done in $(( $(date +%s) - T0 )) s"
grep -h "^link\|^bench\|^trace" /tmp/ep/[sw]_ra.log > $OUT/bench.log
grep -h "^check" /tmp/ep/*_chk.log > $OUT/checks.log
for f in /tmp/ep/[sw]_ra.md; do echo "## $f"; cat $f; done > $OUT/ep_tables.md
tar czf $OUT/call3_logs.tar.gz /tmp/ep/*.log /tmp/ep/*.json 2>/dev/null
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/checks.log"):
    c = json.loads(line[len("check "):])
    worst = max([c.get("y_rel_err", 1), c.get("dx_rel_err", 1), *c.get("dparams_rel_err", {}).values()]) if "error" not in c else None
    print(f"check {c['dispatch']} {c['overlap']} {c['routing']} skew={c['skew']} {c['backend']} vma={c['check_vma']} worst={worst} ok={c['ok']} {c.get('error', '')[:150]}")
for line in open(os.environ["OUT"] + "/bench.log"):
    kind, _, body = line.partition(" ")
    r = json.loads(body)
    if kind == "bench":
        print("bench", r["scaling"], r["T"], r["ep"], r["dispatch"], r["overlap"],
              "fwd %.2f fb %.2f" % (r.get("fwd_ms", -1), r.get("fwd_bwd_ms", -1)), r.get("error", "")[:200])
    elif kind == "trace":
        print("trace", r["T"], r["ep"], r["overlap"], r["device"][-1], "coll %.0f us hidden %.0f us" % (r["collective_us"], r["hidden_us"]),
              [(n[:24], round(d), round(h)) for n, d, h in r["collectives"]][:8])
    else:
        print(line.strip())
PY
