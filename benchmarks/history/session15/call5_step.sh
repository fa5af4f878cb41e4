set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/step
timeout 560 python3 benchmarks/step.py --shapes 7b,30b --variants topk/cp_async --out $OUT/step 2>&1 | grep -v "^I0000\|^W0000" | tail -40
