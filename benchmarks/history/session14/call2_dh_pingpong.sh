set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -p no:xdist -m gpu -q tests/test_gpu.py -k "dh_persistent" 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
timeout 330 python3 benchmarks/history/session14/dh_persistent.py 7b,30b,qwen3 2>&1 | grep -v "^I0000\|^W0000" | tee $OUT/dh_persistent.txt | tail -20
