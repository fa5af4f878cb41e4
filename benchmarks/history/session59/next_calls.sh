# Session 59's GPU calls: `bash benchmarks/history/session59/next_calls.sh PART` from the
# repo root; logs under $OUT.
#   R (~4-7 min, H100 or H200): issue 9: dH's cooperative register stores
#      (`DHConfig(store="registers")`, session 57; never timed): ptxas registers / spills,
#      paired timings at 7B and 30B (2 rounds, bitwise dH / A' on poisoned outputs), then,
#      only if it was bitwise and >= 1.03x the default at 7B or 30B, the step with it
#      (`step.py --shapes 7b,30b --rounds 2`).
#   O (~6-8 min, H100 or H200): issue 9: dH's work items column blocks fastest
#      (`dh.item_coords`, session 59) against the previous order (row tiles fastest),
#      `dh_order.py` at 30B, 7B, 7b-n1024 and gpt-oss-20b (2 paired rounds; bitwise the
#      previous order and against XLA on poisoned outputs); then, if the new order is
#      >= 1.03x at 30B, the step paired against `rows-first-dh` (30B and 7B, 2 rounds);
#      else the dH GPU tests.
#   P (~1.5 min, H100): issue 9, for session 60: where the ping-pong dH's time goes. Applies
#      `dh_pingpong_registers.patch` to the device's copy of the tree, then Nsight Compute
#      source counters of it and of the default at 30B (`timeline.py --run-only`), each
#      summarized by `ncu_source.py`.
#   Q3 (~5 min): dh_order.py at Qwen3-30B-A3B's widths (3 column blocks) and 7b-n512 (2),
#      3 rounds; then the 30B step paired against `rows-first-dh` (2 rounds).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-R}
case "$PART" in
R)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python3 benchmarks/history/session57/dh_regstore.py \
    7b,30b 2 default,registers > $OUT/dh_reg.log 2>&1
  echo "dh registers rc=$? at $(( $(date +%s) - T0 )) s"
  grep -i -E "spill|Used [0-9]+ registers|^== " $OUT/dh_reg.log | head -12
  grep -v "^|" $OUT/dh_reg.log | grep -v -i -E "ptxas|registers,|spill|bytes stack|^ *$" | tail -10
  grep "^|" $OUT/dh_reg.log
  WIN=$(python3 - $OUT/dh_reg.log <<'PY'
import re, sys
text = open(sys.argv[1]).read()
checks = re.findall(r"^  (\S+) bitwise the default \(poisoned, real rows\): (\w+)", text, re.M)
ok = bool(checks) and all(same == "True" for v, same in checks if v == "registers")
rows = re.findall(r"^\| (\S+) \| registers \| [\d.]+ \| ([\d.]+) \|", text, re.M)
print("registers-dh" if ok and any(float(r) >= 1.03 for _, r in rows) else "")
PY
)
  echo "winner: '${WIN}'"
  if [ -n "$WIN" ]; then
    timeout 330 python3 benchmarks/step.py --shapes 7b,30b --variants topk/cp_async,topk/cp_async/$WIN \
      --rounds 2 --out $OUT/step > $OUT/step.log 2>&1
    echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | tail -6
    grep "^|" $OUT/step.log | tail -8
  fi ;;
O)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
  timeout 300 python3 benchmarks/history/session59/dh_order.py 30b,7b,7b-n1024,gpt-oss-20b 2 \
    > $OUT/dh_order.log 2>&1
  echo "dh order rc=$? at $(( $(date +%s) - T0 )) s"
  grep -v "^|" $OUT/dh_order.log | tail -14; grep "^|" $OUT/dh_order.log
  WIN=$(python3 - $OUT/dh_order.log <<'PY'
import re, sys
rows = re.findall(r"^\| 30b \| \d+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \| \S+ \| True \|", open(sys.argv[1]).read(), re.M)
print("yes" if rows and float(rows[0]) >= 1.03 else "")
PY
)
  echo "30B win: '${WIN}'"
  if [ -n "$WIN" ]; then
    timeout 330 python3 benchmarks/step.py --shapes 30b,7b \
      --variants topk/cp_async,topk/cp_async/rows-first-dh --rounds 2 --out $OUT/step > $OUT/step.log 2>&1
    echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | tail -8
    grep "^|" $OUT/step.log | tail -8
  else
    timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "dh" > $OUT/gpu_dh.log 2>&1
    echo "gpu dh rc=$? at $(( $(date +%s) - T0 )) s"; tail -4 $OUT/gpu_dh.log
  fi ;;
Q3)
  timeout 200 python3 benchmarks/history/session59/dh_order.py qwen3-30b-a3b,7b-n512 3 \
    > $OUT/dh_order_q3.log 2>&1
  echo "dh order rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/dh_order_q3.log
  timeout 270 python3 benchmarks/step.py --shapes 30b --variants topk/cp_async,topk/cp_async/rows-first-dh \
    --rounds 2 --out $OUT/step > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/step.log | tail -6
  grep "^|" $OUT/step.log | tail -6 ;;
P)
  git apply benchmarks/history/session59/dh_pingpong_registers.patch || exit 1
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  PP=dh_schedule=pingpong+block_m=128+block_n=128+num_stages=5+epilogue_cols=32
  for K in dh $PP; do
    tag=$([ "$K" = dh ] && echo default || echo pingpong)
    timeout 150 ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
      --section SourceCounters --kernel-name regex:moe_dh --launch-skip 1 --launch-count 1 \
      -o /tmp/$tag python3 benchmarks/timeline.py --run-only --out /tmp/t --shapes 30b \
      --kernels $K > $OUT/ncu_$tag.log 2>&1
    echo "ncu $tag rc=$? at $(( $(date +%s) - T0 )) s"
    ncu -i /tmp/$tag.ncu-rep --page details > $OUT/${tag}_details.txt 2>&1
    ncu -i /tmp/$tag.ncu-rep --page source --csv --print-source sass > /tmp/$tag.csv 2>/dev/null
    gzip -c /tmp/$tag.csv > $OUT/${tag}_sass.csv.gz
    python3 benchmarks/ncu_source.py /tmp/$tag.csv --listing 3000 > $OUT/${tag}_stalls.txt 2>&1
    grep -E "Duration|Compute \(SM\)|L2 Cache Throughput" $OUT/${tag}_details.txt
    sed -n 3,12p $OUT/${tag}_stalls.txt
  done ;;
esac
echo "session 59 part $PART done in $(( $(date +%s) - T0 )) s"
