# Planned for the next session. `bash next_calls.sh PART`; each part <= 10 min, logs under $OUT.
#   nvidia-h200: R (issues 16 / 9: a ring of two staged output slabs, `out_buffers`, on the
#                bf16 down-proj and dX~), F (issue 13: the fp8 down-proj's ring, the 7B fp8
#                down-proj's slab and 4th stage, the fp8 forward on session 37's default),
#                then W (issue 9: the 30B and Qwen3 steps on session 37's bf16 defaults,
#                against the whole-tile configs), then history/session33/next_call_h200.sh A.
#                If R wins, make it the default and run tests/test_gpu.py -k
#                "staged_output_slabs or chunked_row_ffn or matches_xla_at_d_2048" on it.
#   nvidia-h100 (if ever lent): H (the H100's figures for issues 9 and 16 on today's code;
#                the H200's slab rules against the H100's whole tiles).
#   nvidia-h200-x2: history/session36/next_calls.sh E.  -x8: history/session35/next_calls.sh X8.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
case "${1:-R}" in
R)
  # First: session 37's GPU tests ran before `out_buffers` existed; that commit gave the
  # default kernels' staging buffer a leading dimension of 1 (same bytes, same waits). Run
  # them again on today's code.
  timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py tests/test_quant_fp8.py -k \
    "test_staged_output_slabs_equal_the_whole_tile_on_gpu or test_fp8_pingpong_down_on_gpu or test_fp8_up_out_slabs_on_gpu" \
    > $OUT/gpu_tests.log 2>&1; echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_tests.log
  # Session 37: staging the ping-pong's output one slab at a time was 1.012-1.037x on the
  # down-proj, unpredicted. If the gain is the first slab's store starting while the
  # second is written, a ring of two slab buffers (`out_buffers=2`: the whole tile's SMEM,
  # no wait between an item's two slabs) gains more: 1.00-1.02x over one slab. If it is
  # the smaller SMEM write burst beside the other consumer's wgmmas, the ring is level.
  # 30B dX~ (split M, 4 rounds, lost 11% with one slab): the ring of four (the whole tile,
  # eager per-slab stores) 0.98-1.02x against the whole tile.
  timeout 170 python3 benchmarks/forward.py --shapes 7b,30b --skew '' --up-sweep none \
    --down-sweep slabs --no-baselines --out /tmp/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
  timeout 250 python3 benchmarks/backward.py --shapes 7b,30b --sweep slabs --out /tmp/bw > $OUT/backward.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
  S='s/GroupedMatmulConfig(block_m=128, //; s/block_k=64, //; s/num_sms=132, fp8_promote_every=1, gather=.cp_async., gather_completion=.wait_group., //'
  grep "  down Grouped" $OUT/forward.log | sed "$S" | cut -c1-170
  grep "  dX~ Grouped" $OUT/backward.log | sed "$S" | cut -c1-170 ;;
F)
  # Session 37: one staged slab gave the 30B fp8 ping-pong down-proj 1.011-1.012x (the 6th
  # stage 0.99x). The 7B fp8 down-proj is split M (256 columns, 3 stages of 48 KB beside
  # 2 x 32 KB); with one slab 4 stages fit (cuda lowering). Prediction: split M's consumers
  # store together, so the staging alone costs (the bf16 30B dX~ lost 11% that way, 32 K
  # steps); with the 4th stage on 2 K blocks per item, 0.95-1.02x: probably not a win. The
  # ring of two slabs (`out_buffers=2`) as in part R.
  timeout 280 python3 benchmarks/quant.py --fp8 --down-sweep --shapes 7b,30b --out /tmp/q > $OUT/fp8.log 2>&1
  echo "fp8 rc=$? at $(( $(date +%s) - T0 )) s"; cp /tmp/q/fp8_RESULTS.md $OUT/ 2>/dev/null
  grep "^|" $OUT/fp8.log | tail -14 ;;
W)
  # The ping-pong down-proj's slab (1.012-1.037x alone) inside the 30B and Qwen3 steps (dX~
  # is split M there: unchanged). Prediction: 30B ~20-35 us of ~17.9 ms, Qwen3 ~20 us of
  # ~7.4 ms: within the steps' spread unless repeated; the variant is timed twice.
  timeout 560 python3 benchmarks/step.py --out /tmp/st --shapes 30b,qwen3-30b-a3b \
    --variants topk/cp_async,topk/cp_async/whole-tile-down,topk/cp_async > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step.log | tail -8 ;;
H)
  # No H100 since session 21. Issue 9's target (<= 3.0 / 15.6 ms) and SonicMoE's figures
  # are H100 ones. The H100 runs the H100 defaults; the flags give it the H200's choices.
  timeout 560 python3 benchmarks/step.py --out /tmp/st --shapes 7b,30b \
    --variants topk/cp_async,token_rounding/cp_async,topk/cp_async/split-m-up/persistent-wg4 > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step.log | tail -8 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
