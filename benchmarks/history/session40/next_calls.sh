# Session 40 (no GPU lent). `bash benchmarks/history/session40/next_calls.sh PART` from the
# repo root; each part <= 10 min, logs under $OUT. For session 41 (one H200): D first (new
# code, quick), then session 39's prepared parts, which never ran:
#   bash benchmarks/history/session39/next_calls.sh P   # the ping-pong dH (issue 9)
#   bash benchmarks/history/session39/next_calls.sh L   # the flushed-L2 kernel timings
# then S (the step with the new GEMM-only bound). Any H100: session 37's H with --rounds 5.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
case "${1:-D}" in
D)
  # Issue 15: routing and the megakernel's metadata at decode sizes in two Pallas programs
  # (built in session 40 on CPU: bitwise their references in interpret mode, Triton lowering
  # for cuda; never compiled by Triton for a GPU). First their GPU tests: the compiled
  # metadata kernel against the jnp reference on poisoned outputs at T = 1 .. 4096 and four
  # routings, the megakernel with it against xla (static, dynamic, 100 runs bitwise), and
  # the small-batch routing kernel against the dense plan and gradients.
  timeout 260 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py tests/test_gpu.py \
    -k "meta or small_batch_routing" 2>&1 | tail -4
  echo "gpu tests at $(( $(date +%s) - T0 )) s"
  # Then the whole jitted call (routing included), GPU time and wall, same run. Prediction
  # at T = 1 (session 33: static 49.7 us, 31.1 of it the megakernel): static_meta ~44,
  # static+small ~45, static_meta+small 39-41, the MoE kernel unchanged; kernels+small
  # ~4 us under kernels; at T = 32 ~10 us off 333. Refuted if a variant is slower than
  # static at T = 1: then time the new kernels alone (the log lists every kernel) before
  # changing anything. If both win, make them the H200 defaults up to the T where they win
  # (meta_impl default, small_batch_limit) and rerun the decode table.
  timeout 300 python3 benchmarks/decode.py --out $OUT/dec --tokens 1,8,32,128 --iters 20 \
    --variants kernels,kernels+small,static,static_meta,static+small,static_meta+small \
    > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"
  grep "^| \|small-batch routing" $OUT/decode.log | head -40 ;;
S)
  # Issue 9: the 7B and 30B steps against both same-run bounds: the dense XLA layer (what
  # `bound/step` has always meant) and its six GEMMs alone (`GEMMs/step`, new in session 40:
  # the batched-matmul bound as SonicMoE states it). Prediction: the GEMMs alone 0.80-0.90x
  # the dense layer's time (at 7B ~2.3-2.5 ms on an H200 against 2.79), so the step's
  # ratio against them 0.75-0.80 at 7B.
  timeout 400 python3 benchmarks/step.py --out $OUT/st --shapes 7b,30b --rounds 3 \
    --variants topk/cp_async > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^==\|^|" $OUT/step.log | tail -12 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
