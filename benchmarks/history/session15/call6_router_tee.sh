set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 400 python3 benchmarks/history/session15/router_tee.py 7b,30b 2>&1 | grep -v "^I0000\|^W0000" | tee $OUT/router_tee.txt
