# Session 56's GPU calls: `bash benchmarks/history/session56/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   C, E, G, A, N, F: session 55's parts (`benchmarks/history/session55/next_calls.sh`).
#   R (~5 min, H100): issue 15 at T = 1 and 2 after session 56's routing change (the small
#      batch's plan without the scatter, its zeros and the offsets' iota): the routing GPU
#      test (every plan field and the gradient bitwise the dense reference), then
#      session 55's part D (split K of the megakernel's up tasks, two opposite orders),
#      whose kernel lists show the new routing chain.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-R}
case "$PART" in
R)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
  timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_small_batch_routing_kernel_equals_reference" > $OUT/gpu_routing.log 2>&1
  echo "gpu routing rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_routing.log
  bash benchmarks/history/session55/next_calls.sh D ;;
*)
  bash benchmarks/history/session55/next_calls.sh "$PART" ;;
esac
echo "session 56 part $PART done in $(( $(date +%s) - T0 )) s"
