set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/auto
timeout 260 python3 -m train.main --config gpu_7b_layer --steps 40 --backend auto --eval-every 20 --checkpoint-every 0 --no-progress --out $OUT/auto 2>&1 | grep -v "^I0000\|^W0000" | tail -12 > $OUT/train_auto.txt
rm -f $OUT/auto/*.png
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla and 0-True-topk" 2>&1 | tail -4 > $OUT/gpu_tests.txt
cat $OUT/train_auto.txt $OUT/gpu_tests.txt
grep -o '"compile_s": [0-9.]*' $OUT/auto/metrics.jsonl
