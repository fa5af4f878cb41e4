# Session 59's GPU calls: `bash benchmarks/history/session59/next_calls.sh PART` from the
# repo root; logs under $OUT.
#   R (~4-7 min, H100 or H200): issue 9: dH's cooperative register stores
#      (`DHConfig(store="registers")`, session 57; never timed): ptxas registers / spills,
#      paired timings at 7B and 30B (2 rounds, bitwise dH / A' on poisoned outputs), then,
#      only if it was bitwise and >= 1.03x the default at 7B or 30B, the step with it
#      (`step.py --shapes 7b,30b --rounds 2`).
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
esac
echo "session 59 part $PART done in $(( $(date +%s) - T0 )) s"
