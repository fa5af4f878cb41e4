# Planned for the next H200 session (session 30 spent its device time). Four calls of
# <= 10 min and <= 8 files each: `bash next_call_h200.sh A` (items 1 and 3's tests), `B`
# (3's A/B and 5's tests), `C` (4), `D` (5's A/B). Each part tees its logs under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
part=${1:-A}
if [ "$part" = A ]; then
# 1. Issue 16 / 9: why the step reverses the up-proj kernels' order at 7b-n512 (inside the
#    step split-M 0.59 ms vs ping-pong 0.54; alone 0.52 vs 0.59). Each kernel alone, right
#    after the router GEMM (X just read, as in the step), and after a 256-MB pass (X out of
#    L2). If "warm" reproduces the step's order, the L2 state decides: then try (a) ordering
#    the step so the gathering kernels follow a pass over their gathered operand, (b) the
#    split-M kernel's walk (rows of a 128-row item are gathered once per column block).
timeout 300 python3 benchmarks/history/session30/up_context.py 7b,7b-n512,7b-n1024 2>&1 \
  | tee $OUT/up_context.log | grep "^|"
# 2. (Not needed: in the step at the wide shapes (calls 4 and 6) dH takes 0.46-0.48 ms, dW1
#    0.59-0.61, dX~ 0.45-0.51, no worse than at 7B (0.48, 0.63, 0.53 in session 28's step):
#    only the up-proj lost there. `backward.py --shapes 7b-n512,7b-n1024` runs them alone.)
# 3. Issue 15: the decode megakernel's new `gather_completion="mbarrier"` (session 30, CPU
#    only: lowering tests, default jaxprs unchanged). GPU checks first (against xla, bitwise
#    the default completion, 100 runs), then the same-run A/B. Prediction: T = 1 and 8 gain
#    what the producer's `publish` tail costs (timeline call 2: p90 0.9 us per step, ~7 of
#    ~34 us per CTA profiled), i.e. 5-15% at T = 1, less at larger T; if level, the wait
#    was not on the critical path (the consumers' full waits are weights, not rows).
G=tests/test_gpu_decode.py
timeout 300 python3 -m pytest -p no:xdist -q -m gpu "$G::test_matches_xla[1-static_mbarrier]" \
  "$G::test_matches_xla[128-dynamic_mbarrier]" "$G::test_matches_xla[8-unfused_split4_mbarrier]" \
  "$G::test_mbarrier_completion_is_bitwise_the_lagged_publish" \
  "$G::test_hundred_runs_no_hang_bitwise_equal[static_mbarrier]" 2>&1 | tee $OUT/dec_tests.log | tail -3
fi
if [ "$part" = B ]; then
timeout 250 python3 benchmarks/decode.py --out /tmp/dec --tokens 1,8,64,128,1024 \
  --variants kernels,static,static_mbarrier,dynamic,dynamic_mbarrier > $OUT/decode.log 2>&1
cp /tmp/dec/decode_RESULTS.md $OUT/; grep "^|" $OUT/decode_RESULTS.md
fi
if [ "$part" = C ]; then
# 4. Issue 9: does dW1 (the weakest backward kernel, 0.74 / 0.68 of its bound at 7B / 30B)
#    lose L2 work the way the wide-expert up-proj did? Raw metrics of the H200 default at 7B
#    and 30B against the up-proj at 7B (1.58 delivered sectors per served L2 read sector),
#    summed by benchmarks/ncu_l2.py.
for s in 7b 30b; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Chart \
    --section MemoryWorkloadAnalysis_Tables --kernel-name regex:moe_weight_grad_lhs \
    --launch-skip 1 --launch-count 1 -o /tmp/dw1_$s \
    python3 benchmarks/history/session25/wg_run.py $s > $OUT/ncu_dw1_$s.log 2>&1
  ncu -i /tmp/dw1_$s.ncu-rep --page raw --csv 2>/dev/null | gzip > $OUT/raw_dw1_$s.csv.gz
done
#    And the 30B up-proj (split-M, 0.79 of its bound): is its read sharing as good as the
#    7B ping-pong's 1.58? If far lower, the item walk (which CTAs read the same weight
#    tile or rows at the same time) is the next lever for issue 16's 0.85.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 ncu --clock-control none --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Chart \
  --section MemoryWorkloadAnalysis_Tables --kernel-name regex:moe_up_proj --launch-skip 1 \
  --launch-count 1 -o /tmp/up30 python3 benchmarks/timeline.py --run-only --out /tmp/tr \
  --shapes 30b --kernels up > $OUT/ncu_up30.log 2>&1
ncu -i /tmp/up30.ncu-rep --page raw --csv 2>/dev/null | gzip > $OUT/raw_up_30b.csv.gz
python3 benchmarks/ncu_l2.py $OUT/raw_dw1_7b.csv.gz $OUT/raw_dw1_30b.csv.gz \
  benchmarks/history/session30/call2/raw_7b.csv.gz $OUT/raw_up_30b.csv.gz \
  --names dW1-7b,dW1-30b,up-7b,up-30b
fi
if [ "$part" = B ]; then
# 5. Issue 13: SmoothQuant's row maximum with one warpgroup barrier instead of two
#    (`SmoothQuantConfig(row_reduction="one_barrier")`, session 30, CPU only). GPU test (every
#    row bit for bit against numpy), then quant.py's CONFIGS A/B (default first) at 7B / 30B.
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py \
  -k "test_mosaic_kernel_matches_numpy_on_gpu and one_barrier" 2>&1 | tee $OUT/quant_tests.log | tail -2
fi
if [ "$part" = D ]; then
timeout 300 python3 benchmarks/quant.py --out /tmp/q --shapes 7b,30b --token-rounding '' \
  > $OUT/quant.log 2>&1; grep "csr\|one_barrier\|^|" $OUT/quant.log | tail -30
fi
