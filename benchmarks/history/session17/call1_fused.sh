# Needs benchmarks/history/session17/fused_gate_up_experiment.patch applied (calls 1-3 ran with the option on the tree).
set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/fwd
timeout 150 python3 benchmarks/history/session17/fused_bitwise.py 7b,30b 2>&1 | grep -v "^I0000\|^W0000" > $OUT/fused_bitwise.txt
timeout 300 python3 benchmarks/forward.py --shapes 7b,30b --skew "" --up-sweep fused --down-sweep none --no-baselines --out $OUT/fwd 2>&1 | grep -v "^I0000\|^W0000" | tail -40 > $OUT/fwd_stdout.txt
timeout 100 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "up_proj_cp_async and shape3" 2>&1 | tail -6 > $OUT/gpu_tests.txt
cat $OUT/fused_bitwise.txt | tail -8; grep "  up \|bound\|err" $OUT/fwd_stdout.txt | head -30; cat $OUT/gpu_tests.txt
