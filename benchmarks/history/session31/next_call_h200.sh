# Planned for the next H200 session (session 31 spent its device time). `bash
# next_call_h200.sh A|B`; each part <= 10 min and <= 8 files, logs teed under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
part=${1:-A}
S=benchmarks/history/session31
# The L2 metrics benchmarks/ncu_l2.py reads (`METRICS`), and nothing else, so that
# application replay reruns the program as few times as possible.
M=gpu__time_duration.sum,l1tex__m_xbar2l1tex_read_sectors_mem_global_op_tma_ld.sum,l1tex__m_xbar2l1tex_read_sectors_mem_lg_op_ld.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,lts__lts2xbar_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum
ncu_up() {  # name, command...: the up-proj's 3rd launch, the program rerun per pass
  local name=$1; shift
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 270 ncu --replay-mode application \
    --cache-control none --clock-control none --metrics $M --kernel-name regex:moe_up_proj \
    --launch-skip 2 --launch-count 1 -o /tmp/$name "$@" > $OUT/ncu_$name.log 2>&1
  ncu -i /tmp/$name.ncu-rep --page raw --csv 2>/dev/null | gzip > $OUT/raw_$name.csv.gz
}
if [ "$part" = A ]; then
# Issues 16 / 9: inside the 7b-n512 step the split-M up-proj takes 0.58 ms, the ping-pong
# 0.54; alone split-M is 1.05-1.13x faster (session 31 excluded the L2 state of X, clocks,
# the plan and concurrent kernels). Does the split-M kernel's L2 work (delivered / served
# sectors, port busy, DRAM) change inside the step? If its served sectors or DRAM reads
# grow there and the ping-pong's do not, the step's buffer placement / L2 residency of W1
# decides, and the lever is the walk order of split-M items (weights reused while in L2).
ncu_up step_splitm python3 $S/step_run.py 7b-n512 --steps 3
ncu_up step_pingpong python3 $S/step_run.py 7b-n512 pingpong-up --steps 3
python3 benchmarks/ncu_l2.py $OUT/raw_step_splitm.csv.gz $OUT/raw_step_pingpong.csv.gz \
  --names splitM-in-step,pingpong-in-step | tee $OUT/l2_step.txt
fi
if [ "$part" = B ]; then
# The same two kernels alone (timeline.py --run-only: `up` is split-M at 7b-n512 on an
# H200, `up_pingpong` the ping-pong), then all four side by side.
ncu_up alone_splitm python3 benchmarks/timeline.py --run-only --out /tmp/tr --shapes 7b-n512 --kernels up
ncu_up alone_pingpong python3 benchmarks/timeline.py --run-only --out /tmp/tr --shapes 7b-n512 --kernels up_pingpong
# (A's two raw pages are under benchmarks/history/session32/callN/ once copied back.)
python3 benchmarks/ncu_l2.py $OUT/raw_alone_splitm.csv.gz $OUT/raw_alone_pingpong.csv.gz \
  --names splitM-alone,pingpong-alone | tee $OUT/l2_alone.txt
fi
if [ "$part" = C ]; then
# Issue 13: the SmoothQuant kernel on its new default (vec = 4) at 7B (0.74-0.76 of copy,
# never sampled since session 27's TILED rows: that run's 7B profile segfaulted) and 30B
# (0.81-0.83). Registers per thread and the occupancy limit first: session 27's 30B kernel
# (vec 8) had 96 registers, 5 CTAs per SM (31% occupancy), its stalls long-scoreboard on
# the scale row; if vec 4 lowered the registers to raise the CTAs per SM, that is why it
# won, and a register cap (ptxas) or fewer live row registers is the lever at 7B.
NCU="ncu --clock-control none --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy"
for q in "q7 1" "q30 3"; do set -- $q
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 $NCU --kernel-name regex:smoothquant \
    --launch-skip $2 --launch-count 1 -o /tmp/$1 python3 benchmarks/history/session26/quant_run.py \
    > $OUT/ncu_$1.log 2>&1
  ncu -i /tmp/$1.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $OUT/$1_source.csv.gz
  ncu -i /tmp/$1.ncu-rep --page details > $OUT/$1_details.txt 2>&1
  echo "=== $1"; python3 benchmarks/ncu_source.py <(gunzip -c $OUT/$1_source.csv.gz) | sed -n 2,30p
  grep -E "Registers Per|Achieved Occ|Theoretical Occ|Duration|Block Limit" $OUT/$1_details.txt
done 2>&1 | tee $OUT/quant_ncu.txt | tail -80
fi
if [ "$part" = D ]; then
# Issue 15, T = 1 (2.0x the weight-read bound; target 1.3x): the megakernel's ring depth,
# task widths, split K and row loader were swept only on the H100 (session 12; split K on
# the H200 in session 26, no clear gain). The H200 changed the T = 4-8 verdict before
# (session 26), so sweep them here, twice in opposite orders (small-T noise is ~10%).
V=kernels,static,static_s4,static_s6,static_u128,static_bn256,static_split4,static_tma
R=$(echo $V | tr ',' '\n' | tac | paste -sd,)
for run in 1 2; do
  [ $run = 1 ] && vs=$V || vs=$R
  timeout 270 python3 benchmarks/decode.py --out /tmp/dec$run --tokens 1,8 --variants $vs \
    > $OUT/decode_sweep$run.log 2>&1
  cp /tmp/dec$run/decode_RESULTS.md $OUT/decode_sweep$run.md 2>/dev/null
  grep "^|" $OUT/decode_sweep$run.md | sed -n 1,4p
done
fi
