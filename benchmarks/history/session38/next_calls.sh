# Session 38. `bash next_calls.sh PART`; each part <= 10 min, logs under $OUT.
#   P: the decisions that sessions 37-38's single-run timings could not settle, timed
#      round-robin (`--rounds`: every config once per round, paired ratios over the first):
#      - issue 13: the whole fp8 forward against bf16 at 30B. Session 37 measured 1.41x,
#        session 38's call 2 1.57x (bf16 5504 -> 6013 us between the runs, fp8 3894 -> 3835):
#        the bf16 side drifted. Prediction: paired 1.45-1.55x.
#      - issue 9: 30B dX~ (split M, 256 columns). Call 1: whole tile 3254 us, one slab 3201,
#        ring of four 3161; call 3: 3485 / 3294 / 3498, 2x2 3162 (the same config 7% apart).
#        Prediction: every staged variant within 0.98-1.03x of the whole tile paired.
#      - issue 16: the bf16 down-proj's ring of two slabs at 30B (call 1: 1.009x over one slab).
#        Prediction: 0.99-1.01x (not adopted unless > 1.01x with a spread below it).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
S='s/GroupedMatmulConfig(block_m=128, //; s/block_k=64, //; s/num_sms=132, fp8_promote_every=1, gather=.cp_async., gather_completion=.wait_group., //'
case "${1:-P}" in
P)
  timeout 200 python3 benchmarks/quant.py --fp8 --shapes 30b --rounds 7 --out /tmp/q > $OUT/fp8.log 2>&1
  echo "fp8 rc=$? at $(( $(date +%s) - T0 )) s"; cp /tmp/q/fp8_RESULTS.md $OUT/ 2>/dev/null
  grep -o '"bf16_fwd_us.*' $OUT/fp8.log | head -2 | cut -c1-400
  timeout 220 python3 benchmarks/backward.py --shapes 30b --sweep slabs --rounds 5 --out /tmp/bw > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
  grep "  dX~ Grouped" $OUT/backward.log | sed "$S" | cut -c1-230
  timeout 150 python3 benchmarks/forward.py --shapes 30b --skew '' --up-sweep none \
    --down-sweep slabs --no-baselines --rounds 5 --out /tmp/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
  grep "  down Grouped" $OUT/forward.log | sed "$S" | cut -c1-230 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
