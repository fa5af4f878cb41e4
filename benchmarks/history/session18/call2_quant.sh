# Call 2: SmoothQuant CSR kernel, the saturating conversions and the per-token X conversion
# (quant_ab.py: s17, s18a, s18b, cur), GPU tests, Nsight Compute on the kept kernel.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
QUANT_AB_BLOCKS=1,2,4 timeout 300 python3 benchmarks/history/session18/quant_ab.py $OUT 7b,30b 2>&1 | grep -v "^I0000\|^W0000" > $OUT/quant_ab_stdout.txt
timeout 150 python3 -m pytest -p no:xdist -v -m gpu tests/test_quant.py 2>&1 | grep -i "passed\|failed\|error" | tail -15 > $OUT/gpu_tests.txt
NCU="ncu --clock-control none --kernel-name regex:moe_smoothquant --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section InstructionStats --section Occupancy --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis"
timeout 60 $NCU python3 benchmarks/history/session18/ncu_quant.py 30b e4m3 2 > $OUT/ncu_30b_e4m3.txt 2>&1
timeout 60 $NCU python3 benchmarks/history/session18/ncu_quant.py 7b int8 1 > $OUT/ncu_7b_int8.txt 2>&1
tail -24 $OUT/quant_ab_stdout.txt | grep "^|\|numpy\|error"; cat $OUT/gpu_tests.txt
grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc Active|No Eligible|Theoretical Occupancy|Memory Throughput|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Executed Instructions  " $OUT/ncu_30b_e4m3.txt $OUT/ncu_7b_int8.txt
