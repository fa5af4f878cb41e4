# Session 24, call 3: call 2 again with the up-proj rows running untimed (timeline.py
# --run-only: ncu holds CUPTI, which the Mosaic profiler needs) and with explicit metrics:
# tensor-pipe activity, SMEM wavefronts (LDS/STS/LDGSTS/GMMA all pass the same data stage),
# bank conflicts per op, the bytes GMMA reads and LDGSTS writes. Rows: the dense batched
# matmul of the up-proj's FLOPs (cuBLAS), the split-M up-proj K loop (cp.async, mbarrier
# completion, no epilogue), its feed alone (nomma), its wgmmas alone (nofeed), dH's K loop.
export PYTHONPATH=. PYTHONUNBUFFERED=1
C=up_coop+block_m=128+fused+interleaved+num_stages=4+gather_completion=mbarrier+noepilogue
M=gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_gmma.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_misc.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_cmd_write.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_cmd_read.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ldgsts.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_gmma.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,sm__sass_data_bytes_mem_shared_op_gmma.sum,sm__sass_data_bytes_mem_shared_op_ldgsts.sum,sm__sass_inst_executed_op_ldgsts.sum,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed
NCU="ncu --clock-control none --metrics $M"
timeout 100 $NCU --kernel-name regex:"nvjet|gemm" --launch-skip 1 --launch-count 1 \
  python3 benchmarks/history/session24/dense_bmm.py > $OUT/m_dense.txt 2>&1
i=0
for k in $C $C+nomma $C+nofeed dh_noepilogue; do
  i=$((i+1))
  timeout 120 $NCU --kernel-name regex:"moe_up_proj|moe_dh" --launch-skip 1 --launch-count 1 \
    python3 benchmarks/timeline.py --run-only --out $OUT/t$i --shapes 7b --kernels $k > $OUT/m_$i.txt 2>&1
done
for f in $OUT/m_dense.txt $OUT/m_1.txt $OUT/m_2.txt $OUT/m_3.txt $OUT/m_4.txt; do
  echo "=== $f"; grep -E "^    [a-z]|ERROR|Traceback|Error" $f | sed 's/  */ /g' | head -30
done
