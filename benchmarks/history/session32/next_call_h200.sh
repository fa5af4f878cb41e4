# Planned for the next H200 session (session 32 spent its device time). `bash
# next_call_h200.sh A|B|C|D|E`; each part <= 10 min and <= 8 files, logs teed under $OUT.
# Issue 15 first: session 32 removed the padding-row hot spot of the megakernel's gather
# (T = 1: 48 -> 31 us of MoE kernels, 1.40x the weight-read bound; target 1.3x), so every
# earlier T = 1 verdict (split K, lookahead, ring depth) is open again, and the op's batch
# limit (`H200_DECODE_MAX_TOKENS = 8`) may move. Session 31's prepared parts
# (`history/session31/next_call_h200.sh A-D`: up-proj L2 in the step, SmoothQuant ncu, the
# decode config sweep) come after these.
export PYTHONPATH=. PYTHONUNBUFFERED=1
part=${1:-A}
if [ "$part" = A ]; then
# The megakernel's GPU tests, first half: every variant against xla (36 cases, ~7 s each;
# the new `*_early` and `static_next` variants included; the session-32 build passed the
# quick subset of 12). Part E is the second half.
timeout 570 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py -k "matches_xla" \
  > $OUT/gpu_decode_1.log 2>&1; tail -3 $OUT/gpu_decode_1.log
fi
if [ "$part" = E ]; then
# Second half: edge cases, H, the early weights bitwise, 100 runs per variant, the op.
timeout 570 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py -k "not matches_xla" \
  > $OUT/gpu_decode_2.log 2>&1; tail -3 $OUT/gpu_decode_2.log
fi
if [ "$part" = B ]; then
# T = 1 and 8 without the hot spot: the weight tiles before the row ids (`early_weights`),
# the L2 lookahead (the 92 up-then-down CTAs' W2 prefetched during their up task's last
# steps), the same into the next task only (`lookahead_within_task=False`: no W1 requested
# ahead of the ring), with the early weights, 6 and 7 stages (7 fits without H only; the
# bare stream of the up tasks' strips was 0.73x of rows at 5 stages, level at 8); twice in opposite
# orders. Session 32's phases say T = 1 runs up (~17-19 us), down (~9) and aggregation
# (~3) in series; prediction: the next-task lookahead moves most of the down phase's W2
# reads under the up phase (~27 us of MoE kernels, 1.2x the bound). A variant that wins
# at T = 1 in both runs by more than the runs differ becomes the default (then rerun part
# A's tests on it).
V=kernels,static,static_early,static_ahead,static_next16,static_early_next16,static_s6,static_s7
R=$(echo $V | tr ',' '\n' | tac | paste -sd,)
for run in 1 2; do
  [ $run = 1 ] && vs=$V || vs=$R
  timeout 280 python3 benchmarks/decode.py --out /tmp/dec$run --tokens 1,8 --variants $vs \
    --iters 50 > $OUT/decode_sweep$run.log 2>&1
  cp /tmp/dec$run/decode_RESULTS.md $OUT/decode_sweep$run.md 2>/dev/null
  grep -E "WRONG|failed" $OUT/decode_sweep$run.log | head -5
  grep "^|" $OUT/decode_sweep$run.md | head -8
done
fi
if [ "$part" = C ]; then
# The decode table for RESULTS.md and the op's batch limit on an H200: the kernel path,
# both schedulers, the unfused control and the op's own choice (`auto`) at T = 1-1024.
# If the megakernel now wins at T = 16 (or 32) in this run and in part B's T = 8 figures,
# raise `moe_forward.H200_DECODE_MAX_TOKENS` (and its test) accordingly.
timeout 570 python3 benchmarks/decode.py --out /tmp/decC --tokens 1,8,16,32,64,128,1024 \
  --variants kernels,static,dynamic,unfused,auto > $OUT/decode_table.log 2>&1
cp /tmp/decC/decode_RESULTS.md $OUT/decode_table.md 2>/dev/null
grep "^|" $OUT/decode_table.md | head -20
fi
if [ "$part" = D ]; then
# Where T = 1's remaining 9 us above the bound go, on the fixed kernel: the phases
# (up / down / aggregation alone and together, metadata precomputed) against the bare
# stream of W1, and the up tasks with `early_weights`.
timeout 400 python3 benchmarks/history/session32/decode_phases.py --out $OUT --tokens 1 \
  2>&1 | grep -v cuda_event | tail -20
fi
