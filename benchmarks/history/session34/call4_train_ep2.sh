# Session 34, call 4 (nvidia-h200-x2).
# 1. Issue 17: the ragged collective's NCCL send/recv path (call 3: with the one-shot kernel
#    off XLA refused to fall back to NCCL unless allowed).
# 2. Issue 17: the training job with the Mosaic kernels (`gpu_7b_layer`: 4 MoE layers at the
#    7B shape, T = 24576 tokens per step, bf16) on one GPU twice side by side (GPU 0 and
#    GPU 1: tokens/s and the run-to-run noise of the loss), then on both GPUs with EP = 2
#    (all_gather dispatch: on two GPUs with K = 8 it moves 1/4 of the ragged bytes; calls 2-3).
# 3. Issue 13 (session 33's next_call C): x_per_row's GPU test and ncu's register counts.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/ep
T0=$(date +%s)
XLA_FLAGS="--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true" \
  timeout 60 python3 benchmarks/ep.py --ep 2 --exchange-rows 32768,131072 2>&1 | grep "^exchange" | tee $OUT/exchange_nccl.log | cut -c1-400
echo "exchange done at $(( $(date +%s) - T0 )) s"
TRAIN="python3 -m train.main --config gpu_7b_layer --steps 30 --eval-every 10 --checkpoint-every 0 --no-progress"
( CUDA_VISIBLE_DEVICES=0 timeout 200 $TRAIN --out /tmp/ep/t1a > /tmp/ep/t1a.log 2>&1; echo "t1a rc=$?" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 200 $TRAIN --out /tmp/ep/t1b > /tmp/ep/t1b.log 2>&1; echo "t1b rc=$?" ) &
wait
echo "one-GPU runs done at $(( $(date +%s) - T0 )) s"
timeout 220 $TRAIN --set devices=0 --set expert_parallel=2 --set dispatch=all_gather --out /tmp/ep/t2 > /tmp/ep/t2.log 2>&1; echo "t2 rc=$?"
echo "EP run done at $(( $(date +%s) - T0 )) s"
for r in t1a t1b t2; do grep "^done\|Error" /tmp/ep/$r.log | tail -2; done
python3 benchmarks/history/session34/compare_runs.py /tmp/ep/t1a /tmp/ep/t1b > $OUT/train_compare.txt 2>&1
python3 benchmarks/history/session34/compare_runs.py /tmp/ep/t1a /tmp/ep/t2 >> $OUT/train_compare.txt 2>&1
cat $OUT/train_compare.txt
tar czf $OUT/call4_logs.tar.gz /tmp/ep/*.log /tmp/ep/t*/metrics.jsonl 2>/dev/null
LEFT=$((560 - $(date +%s) + T0))
echo "issue 13 with $LEFT s left"
if [ $LEFT -gt 120 ]; then
  timeout 100 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py \
    -k "test_mosaic_kernel_matches_numpy_on_gpu and (x_per_row or default)" 2>&1 | tail -2
  for c in default x_per_row; do
    LEFT=$((570 - $(date +%s) + T0)); [ $LEFT -lt 40 ] && break
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $((LEFT / 2)) ncu --clock-control none --section LaunchStats \
      --section Occupancy --kernel-name regex:smoothquant --launch-skip 1 --launch-count 3 \
      python3 benchmarks/history/session33/quant_run.py $c > $OUT/ncu_quant_$c.txt 2>&1
    echo "== $c"; grep -E "smoothquant|Registers Per|Block Limit Registers|Achieved Occ" $OUT/ncu_quant_$c.txt | head -8
  done
fi
