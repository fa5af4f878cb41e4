# Session 41 (no GPU lent). `bash benchmarks/history/session41/next_calls.sh PART` from the
# repo root; each part <= 10 min, logs under $OUT. For the next session with one H200:
#   1. U (below; ~3-4 min on a warm machine), then session 40's D:
#        bash benchmarks/history/session40/next_calls.sh D   # decode metadata + small routing
#   2. session 39's prepared parts, which never ran:
#        bash benchmarks/history/session39/next_calls.sh P   # the ping-pong dH (issue 9)
#        bash benchmarks/history/session41/next_calls.sh R   # its registers and spills
#        bash benchmarks/history/session39/next_calls.sh L   # the flushed-L2 kernel timings
#   3. bash benchmarks/history/session40/next_calls.sh S     # the step against both bounds
# Any H100: session 37's H with --rounds 5.
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
case "${1:-U}" in
U)
  # Issue 16: session 41 removed the up-proj's non-default variants (the one-CTA-per-tile
  # split-M form, two producer warpgroups, the whole-block epilogue). The jaxpr of every
  # remaining config is identical to before on CPU (but one integer add of 0), so the
  # compiled kernels should be too; the up-proj's GPU tests confirm it on the device
  # (poisoned outputs; the persistent split-M forms now carry the split-M cases), and the
  # op against xla at the widths that run split-M (d = 2048) and the ping-pong (7B).
  timeout 420 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "up_proj or mosaic_matches_xla_at_d_2048 or wide_experts" 2>&1 | tail -4
  echo "gpu tests at $(( $(date +%s) - T0 )) s" ;;
R)
  # Issue 9: ptxas's registers and spills of the persistent dH and the ping-pong dH at 7B
  # (each compiled in its own process, dumps under $OUT/regs/dump), with one timing each.
  # Run it right after session 39's P in the same call: if the ping-pong dH measures slower
  # than the default, the first suspect is spills in its epilogue beside two live
  # accumulators (session 14's ping-pong spilled); this answers it without a second call.
  timeout 500 python3 benchmarks/history/session41/dh_regs.py $OUT/regs coop,pp,pp_mbarrier \
    2>&1 | tail -20
  echo "regs at $(( $(date +%s) - T0 )) s" ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
