# Session 24, call 2: Nsight Compute on the split-M up-proj K loop (cp.async, mbarrier
# completion, no epilogue) and its two halves (nomma: feed alone; nofeed: wgmmas alone),
# beside the dense batched matmul of the same FLOPs. Question: is the K loop's
# 1.3x-over-the-slower-half contention SMEM bandwidth (L1/shared throughput near its peak,
# bank conflicts on the cp.async writes) or something else?
export PYTHONPATH=. PYTHONUNBUFFERED=1
C=up_coop+block_m=128+fused+interleaved+num_stages=4+gather_completion=mbarrier+noepilogue
SECT="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy"
ncu --version > $OUT/ncu_version.txt 2>&1
# (ran in call 2; the up-proj rows failed: CUPTI held by ncu) timeout 100 ncu --clock-control none --kernel-name regex:"gemm|nvjet|xmma|cutlass" --launch-skip 1 --launch-count 1 $SECT \
#  python3 benchmarks/history/session24/dense_bmm.py > $OUT/ncu_dense.txt 2>&1
i=0
for k in $C $C+nomma $C+nofeed; do
  i=$((i+1))
  timeout 140 ncu --clock-control none --kernel-name regex:moe_up_proj --launch-skip 1 --launch-count 1 $SECT \
    python3 benchmarks/timeline.py --run-only --out $OUT/t$i --shapes 7b --kernels $k > $OUT/ncu_up_$i.txt 2>&1
done
# ncu --query-metrics --chip gh100 2>/dev/null | grep -i "shared\|gmma\|tensor_op\|ldgsts" > $OUT/ncu_metric_names.txt
for f in $OUT/ncu_dense.txt $OUT/ncu_up_1.txt $OUT/ncu_up_2.txt $OUT/ncu_up_3.txt; do
  echo "=== $f"; grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|DRAM Throughput|Compute \(SM\) Throughput|Executed Ipc A|Issue Slots Busy|Shared |Bank|ERROR|Registers Per|Achieved Occ|Warp Cycles Per Issued" $f | head -40
done
