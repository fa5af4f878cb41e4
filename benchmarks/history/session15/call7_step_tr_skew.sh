set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/tr $OUT/skew
timeout 330 python3 benchmarks/step.py --shapes 7b,30b --variants token_rounding/cp_async,topk/cp_async --out $OUT/tr 2>&1 | grep -v "^I0000\|^W0000" | grep -v "^    kernels" | tail -12
timeout 200 python3 benchmarks/step.py --shapes 7b --variants topk/cp_async --skew 1.0 --out $OUT/skew 2>&1 | grep -v "^I0000\|^W0000" | tail -6
