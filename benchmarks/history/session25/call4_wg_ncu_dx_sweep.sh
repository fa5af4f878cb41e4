# Session 25, call 4 (H200): where the weight gradients' time goes at 30B, the step's
# largest gap to its bound (in call 3's step dW1 4.55 ms + dW2 2.51 ms against a dense bound
# of ~4.2 ms for both): Nsight Compute metrics of each (tensor pipe, SMEM wavefronts, L2,
# DRAM, warp stalls), with session 24 call 3's metric list. Then dX~ tile configs at 30B and
# the Qwen3 widths (CUPTI, same run): today's split M with 256-column items and 3 stages
# against 128-column items with 4 stages, split M and ping-pong.
export PYTHONPATH=. PYTHONUNBUFFERED=1
M=gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_bytes.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
NCU="ncu --clock-control none --metrics $M"
i=0
for k in moe_weight_grad_lhs moe_weight_grad_rhs; do
  i=$((i+1))
  timeout 150 $NCU --kernel-name regex:$k --launch-skip 1 --launch-count 1 \
    python3 benchmarks/history/session25/wg_run.py 30b > $OUT/m_$i.txt 2>&1
done
for f in $OUT/m_1.txt $OUT/m_2.txt; do
  echo "=== $f"; grep -E "^    [a-z]|ERROR|Traceback|Error" $f | sed 's/  */ /g' | head -24
done
timeout 200 python3 benchmarks/timeline.py --plain --out $OUT/dx --shapes 30b,qwen3-30b-a3b \
  --kernels dx,dx_block_n=128+num_stages=4,dx_block_n=128+num_stages=4+pingpong=True \
  2>&1 | grep "^|"
