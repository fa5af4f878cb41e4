# Session 38. `bash next_calls.sh PART`; each part <= 10 min, logs under $OUT.
# P ran as session 38's call 4. For session 39 (one H200, in this order): S7, S30, F8, then
# `history/session33/next_call_h200.sh A` (issue 15); `history/session37/next_calls.sh H`
# if an H100 is lent (add `--rounds 5` to its step.py line).
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
S7)
  # Issue 9, the 7B step paired (step.py --rounds: the dense bound and each variant once per
  # round). Session 37, one timing each: 3.133-3.134 ms on the defaults, 3.154 with the
  # whole-tile down-proj and dX~, bound 2.755 (0.88). Prediction: paired 0.87-0.89 of the
  # bound; whole-tile-down 0.99-1.00x of the default; token rounding within 2% of top-K.
  timeout 580 python3 benchmarks/step.py --out /tmp/st --shapes 7b --rounds 5 \
    --variants topk/cp_async,topk/cp_async/whole-tile-down,token_rounding/cp_async > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|paired over" $OUT/step.log | tail -12 ;;
S30)
  # Issue 9 at 30B and the Qwen3 widths, paired (session 37's part W, never run): the
  # down-proj's one slab (0.962x for the whole tile alone, paired, session 38 call 4) inside
  # the steps. Prediction: 30B whole-tile-down 0.99-1.00x (~60 us of ~18 ms), Qwen3 0.99x.
  timeout 580 python3 benchmarks/step.py --out /tmp/st --shapes 30b,qwen3-30b-a3b --rounds 3 \
    --variants topk/cp_async,topk/cp_async/whole-tile-down > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|paired over" $OUT/step.log | tail -12 ;;
F8)
  # Issue 13: the fp8 down-proj sweep paired (session 37 adopted the 30B slab on 1.011-1.012x,
  # one timing each; session 38's single run gave the ring of two 1.017x) and the 7B fp8
  # forward paired (1.16x single). Prediction: slab vs whole tile 1.00-1.02x paired, the ring
  # 0.99-1.01x (the bf16 ring was level paired); 7B fwd 1.13-1.18x.
  timeout 420 python3 benchmarks/quant.py --fp8 --down-sweep --shapes 7b,30b --rounds 5 \
    --out /tmp/q > $OUT/fp8.log 2>&1
  echo "fp8 rc=$? at $(( $(date +%s) - T0 )) s"; cp /tmp/q/fp8_RESULTS.md $OUT/ 2>/dev/null
  grep -o '"fwd_speedup_paired[^,]*' $OUT/fp8.log; grep "down sweep:" $OUT/fp8.log | cut -c1-900 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
