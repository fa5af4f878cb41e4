# Session 27, call 2: per-instruction (SASS) warp-stall sampling and executed counts, as
# call 1 did for the up-proj: the SmoothQuant CSR kernel (issue 13; call 1's metrics: 7B
# e4m3 66% issue-active with 72 registers, 30B int8 41% with 133 registers and 3 CTAs per
# SM) at 7B e4m3 and 30B int8, and the 7B dW1 (issue 9's largest weight gradient).
export PYTHONPATH=. PYTHONUNBUFFERED=1
S=benchmarks/history/session27
NCU="ncu --clock-control none --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy"
run() {  # name, kernel regex, launches to skip, command...
  local name=$1 re=$2 skip=$3; shift 3
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 $NCU --kernel-name regex:$re --launch-skip $skip \
    --launch-count 1 -o /tmp/$name "$@" > /tmp/${name}_log.txt 2>&1
  ncu -i /tmp/$name.ncu-rep --page source --csv --print-source sass > /tmp/${name}.csv 2>/dev/null
  ncu -i /tmp/$name.ncu-rep --page details > /tmp/${name}_details.txt 2>&1
  python3 benchmarks/ncu_source.py /tmp/${name}.csv > /tmp/${name}_stalls.txt 2>&1
}
run q7 smoothquant 1 python3 benchmarks/history/session26/quant_run.py
run q30 smoothquant 5 python3 benchmarks/history/session26/quant_run.py
run dw1 moe_weight_grad_lhs 1 python3 benchmarks/history/session25/wg_run.py 7b
tar czf $OUT/sass.tgz -C /tmp q7.csv q30.csv dw1.csv q7_details.txt q30_details.txt dw1_details.txt q7_log.txt q30_log.txt dw1_log.txt
for n in q7 q30 dw1; do echo "=== $n"; sed -n 2,40p /tmp/${n}_stalls.txt; grep -E "Registers Per|Achieved Occ|Theoretical Occ|Duration|Block Limit" /tmp/${n}_details.txt; done
