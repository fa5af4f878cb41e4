set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/auto $OUT/xla
for b in auto xla; do
timeout 285 python3 -m train.main --config gpu_7b_layer --steps 40 --backend $b --eval-every 20 --checkpoint-every 0 --no-progress --out $OUT/$b 2>&1 | grep -v "^I0000\|^W0000" | tail -12 > $OUT/train_$b.txt
rm -f $OUT/$b/*.png
done
tail -4 $OUT/train_auto.txt $OUT/train_xla.txt
