# Call 1: issue 13's int8 question (which of kernels / XLA-GPU / XLA-CPU is off), then the
# on-device timelines of the up-proj (7B, 30B) and the persistent dH (7B).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/history/session19/int8_stages.py > $OUT/int8_stages.txt 2>&1
tail -12 $OUT/int8_stages.txt
(while true; do nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw --format=csv,noheader >> $OUT/clocks.txt; sleep 2; done) &
timeout 400 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels up,up_inference,dh 2>&1 | grep -v "^WARNING\|Warning" | tail -60
timeout 200 python3 benchmarks/timeline.py --out $OUT/30b --shapes 30b --kernels up 2>&1 | grep -v "^WARNING\|Warning" | tail -25
kill %1 2>/dev/null
