set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 540 python3 benchmarks/history/session15/regs.py $OUT 2>&1 | grep -v "^I0000\|^W0000" | tee $OUT/regs.txt
