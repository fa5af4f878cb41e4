set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/step
timeout 570 python3 benchmarks/step.py --shapes 120b-n512,120b,120b-n2048 --variants topk/cp_async --out $OUT/step 2>&1 | grep -v "^I0000\|^W0000" | tail -20 > $OUT/step_120b_log.txt
tail -8 $OUT/step_120b_log.txt
