# Issue 17 on `nvidia-h200-x2` (lent for the first time late in session 30; call 7 ran 3 of the
# ragged dispatch's kernel-path checks, all within tolerance). One session's device time
# (30 min) fits the rest as five calls of <= 600 s (call 7: ~50 s per check case with its
# compiles). Run them in this order; each tees its log under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
EP="python3 benchmarks/ep.py --backend mosaic --ep 2"
case "$1" in
  # A: the ragged dispatch's remaining checks (skewed token rounding, chunked overlap) and
  #    its xla path under check_vma=True.
  A) timeout 560 $EP --dispatch ragged_all_to_all --overlap none,chunked \
       --check-routings token_rounding --skip-bench --out $OUT/ep_A.md 2>&1 | tee $OUT/ep_A.log | grep "^check" | cut -c1-200 ;;
  B) timeout 560 $EP --dispatch ragged_all_to_all --overlap chunked --check-routings topk \
       --skip-bench --out $OUT/ep_B.md 2>&1 | tee $OUT/ep_B.log | grep "^check" | cut -c1-200 ;;
  # C: the all_gather dispatch's checks.
  C) timeout 560 $EP --dispatch all_gather --overlap none --skip-bench --out $OUT/ep_C.md 2>&1 \
       | tee $OUT/ep_C.log | grep "^check" | cut -c1-200 ;;
  # D: strong scaling at the 30B layer (T = 32768 global), EP = 1 against EP = 2, every
  #    dispatch and overlap, with where the compiled forward puts the overlaps.
  D) timeout 560 $EP --skip-check --scaling strong --iters 5 --out $OUT/ep_D.md 2>&1 \
       | tee $OUT/ep_D.log | grep "^bench" | cut -c1-250 ;;
  # E: weak scaling (4096 tokens per GPU).
  E) timeout 560 $EP --skip-check --scaling weak --iters 5 --out $OUT/ep_E.md 2>&1 \
       | tee $OUT/ep_E.log | grep "^bench" | cut -c1-250 ;;
  # F (if time is left): the training job on both GPUs with EP against one GPU.
  F) timeout 280 python3 -m train.main --config small --steps 60 --set devices=0 \
       --set expert_parallel=2 --set dispatch=ragged_all_to_all --out /tmp/train_ep2 2>&1 \
       | tee $OUT/train_ep2.log | tail -20 ;;
esac
