# Session 42. `bash benchmarks/history/session42/next_calls.sh PART` from the repo root; each
# part <= 10 min, logs under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
case "${1:-D}" in
D)
  # Issue 15: the decode defaults by batch size (session 42): the metadata kernel up to
  # META_KERNEL_MAX_TOKENS = 4 tokens (`DecodeConfig.meta_impl="auto"`), one-program routing
  # up to SMALL_BATCH_DEFAULT = 8. `static` is the new default; `static_jnp+blocks` the
  # old one; the others pin one choice each. Session 41 measured T = 1 and 8 only.
  # Prediction: static at T = 1 ~39-40 us (= static_meta+small), at T = 8 ~179-180
  # (= static_jnp+small, the metadata kernel off); static never slower than the best
  # pinned variant by more than noise (~1 us) at T = 1, 2, 4, 8, 16. Refuted where a pinned
  # variant beats static by > 2 us: then move the threshold to where it measured.
  timeout 250 python3 benchmarks/decode.py --out $OUT/dec --tokens 1,2,4,8,16 --iters 20 \
    --variants kernels,static,static_jnp+blocks,static_meta+blocks,static_jnp+small,static_meta+small \
    > $OUT/decode.log 2>&1
  echo "decode rc=$? at $(( $(date +%s) - T0 )) s"
  grep "^| \|small-batch routing" $OUT/decode.log | head -30 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
