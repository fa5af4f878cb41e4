# Planned for the next H200 session. `bash next_call_h200.sh A|B|C`; each part <= 10 min and
# <= 8 files, logs under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
part=${1:-A}
if [ "$part" = A ]; then
# Issue 15, T = 1 (1.39x the weight-read bound, target 1.3x): the megakernel takes 31.4 us
# inside the op's jitted call and 28.3 us in a loop of itself (session 33, calls 1-2), the
# difference being about what separates it from 1.3x (29.2). Which context costs: a small
# XLA kernel in front, an L2 emptied by a 128-MB pass, the metadata's kernels, the whole
# op. If `after_small_xla` alone costs the 3 us, the launch state (carve-out) is the cause
# and the lever is fusing the metadata into the megakernel's first phase; if
# `after_big_xla` does, it is L2 residency of the weights between calls (then the bound
# itself, HBM-only, is what the 28.3 us loop was beating, and the op's 31.4 is honest).
# Session 33's call 9 ran one round at T = 1 before its timeout: alone 28.3, after small
# XLA 28.8, after the 128-MB pass 29.6, metadata inside 30.5; this call completes it
# (three rounds, the whole op, and T = 8).
timeout 300 python3 benchmarks/history/session33/decode_context.py --out $OUT --tokens 1,8 \
  2>&1 | grep -v cuda_event | tail -16
fi
if [ "$part" = B ]; then
# Issues 16 / 9: session 31's question (does the split-M up-proj's L2 traffic change inside
# the 7b-n512 step?) with ncu's kernel replay instead of the application replay that
# segfaulted the program in session 33 (call 5).
S=benchmarks/history/session31
M=gpu__time_duration.sum,l1tex__m_xbar2l1tex_read_sectors_mem_global_op_tma_ld.sum,l1tex__m_xbar2l1tex_read_sectors_mem_lg_op_ld.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,lts__lts2xbar_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum  # ncu_l2.py's METRICS
for v in "splitm 7b-n512" "pingpong 7b-n512 pingpong-up"; do set -- $v; name=$1; shift
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 250 ncu --replay-mode kernel --cache-control none \
    --clock-control none --metrics $M --kernel-name regex:moe_up_proj --launch-skip 2 \
    --launch-count 1 -o /tmp/$name python3 $S/step_run.py "$@" --steps 3 > $OUT/ncu_$name.log 2>&1
  ncu -i /tmp/$name.ncu-rep --page raw --csv 2>/dev/null | gzip > $OUT/raw_$name.csv.gz
done
python3 benchmarks/ncu_l2.py $OUT/raw_splitm.csv.gz $OUT/raw_pingpong.csv.gz \
  --names splitM-in-step,pingpong-in-step | tee $OUT/l2_step.txt
fi
if [ "$part" = C ]; then
# Issue 13 at 7B (0.74-0.76 of copy, target 0.8): `SmoothQuantConfig(x_per_row=True)`
# holds the token's X row in bf16 (6 registers per thread at d = 1536 instead of 12 f32).
# (1) Its GPU test (every row against numpy, int8 and e4m3); (2) ncu's register count and
# occupancy for both configs (if ptxas hoisted the conversion back out of the row loop,
# the counts are equal and the option is moot); (3) benchmarks/quant.py at 7B and 30B
# (every CONFIGS entry, x_per_row last). Predicted: 7B 48-50 registers, 10 CTAs per SM,
# 1.03-1.08x; 30B 80 registers, 6 CTAs, 1.05-1.10x.
timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py \
  -k "test_mosaic_kernel_matches_numpy_on_gpu and (x_per_row or default)" 2>&1 | tail -2
for c in default x_per_row; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 ncu --clock-control none --section LaunchStats \
    --section Occupancy --kernel-name regex:smoothquant --launch-skip 1 --launch-count 3 \
    python3 benchmarks/history/session33/quant_run.py $c > $OUT/ncu_quant_$c.txt 2>&1
  echo "== $c"; grep -E "smoothquant|Registers Per|Block Limit Registers|Achieved Occ" $OUT/ncu_quant_$c.txt
done
timeout 280 python3 benchmarks/quant.py --out /tmp/q --shapes 7b,30b --token-rounding '' \
  > $OUT/quant.log 2>&1; cp /tmp/q/*RESULTS*.md $OUT/ 2>/dev/null; grep "^|" /tmp/q/*RESULTS*.md | head -30
fi
# Issue 17 whenever `nvidia-h200-x2` is lent: benchmarks/history/session30/next_calls_h200x2.sh A..F.
