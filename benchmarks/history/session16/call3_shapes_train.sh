set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/step $OUT/train
timeout 170 python3 -m train.main --config gpu_7b_layer --steps 40 --backend auto --eval-every 20 --checkpoint-every 0 --out $OUT/train/auto 2>&1 | grep -v "^I0000\|^W0000" | tail -15 > $OUT/train_auto.txt
timeout 380 python3 benchmarks/step.py --shapes 7b-n512,7b-n1024,30b-n256,30b-n1024 --variants topk/cp_async --out $OUT/step 2>&1 | grep -v "^I0000\|^W0000" | tail -20 > $OUT/step_shapes_log.txt
cat $OUT/train_auto.txt; tail -8 $OUT/step_shapes_log.txt
