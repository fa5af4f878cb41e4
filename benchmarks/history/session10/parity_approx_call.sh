#!/bin/bash
mkdir -p $OUT/logs
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python -m train.parity --config tiny --train-steps 300 --backend mosaic --out /tmp/par_exact --no-progress > $OUT/logs/parity_exact_stdout.txt 2>&1
timeout 200 python -m train.parity --checkpoint /tmp/par_exact/model --backend mosaic --approx-math --out /tmp/par_approx > $OUT/logs/parity_approx_stdout.txt 2>&1
cp /tmp/par_exact/parity.json $OUT/logs/parity_exact.json; cp /tmp/par_approx/parity.json $OUT/logs/parity_approx.json
grep "^| \|^Reference\|^model" $OUT/logs/parity_exact_stdout.txt | cut -c1-220
grep "^| \|^Reference\|^model" $OUT/logs/parity_approx_stdout.txt | cut -c1-220
tail -3 $OUT/logs/parity_approx_stdout.txt | cut -c1-300
cd $OUT && tar czf logs.tgz logs && rm -rf logs
