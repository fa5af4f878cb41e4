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
