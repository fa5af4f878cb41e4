# Session 32, call 3 (issue 15): call 2 found the megakernel's up tasks alone take 36 us at
# T = 1 where the bare stream of the same W1 bytes in the same order takes 10.5, with a
# per-step floor (~1.1 us per K step: 3 -> 5 -> 6 stages gave 51 -> 36 -> 35 us). Which
# part of a step holds it: the up tasks alone with the gathered rows' cp.async loads
# skipped (the producer arrives on `full` right after the weight TMAs), with the consumers'
# wgmmas skipped, and both (decode_diag.patch, applied to a copy; garbage outputs, timing
# only), against the unpatched kernel and the bare stream in the same call.
export PYTHONPATH=. PYTHONUNBUFFERED=1
run() {  # name, env...
  local name=$1; shift
  env "$@" timeout 150 python3 benchmarks/history/session32/decode_phases.py --out /tmp/$name \
    --tokens 1,8 --only up,up_s6,probe_up --rounds 3 > $OUT/$name.log 2>&1
  echo "== $name"; grep "^|" $OUT/$name.log
}
run base
rm -rf /tmp/p && mkdir /tmp/p && cp -r pallas_moe benchmarks tests /tmp/p/ && cd /tmp/p && \
  git apply --unsafe-paths --directory=. $OLDPWD/benchmarks/history/session32/decode_diag.patch 2>&1 \
  || patch -p1 < $OLDPWD/benchmarks/history/session32/decode_diag.patch
grep -c DIAG_ pallas_moe/kernels/decode.py
run no_gather PM_DIAG_NO_GATHER=1
run no_mma PM_DIAG_NO_MMA=1
run neither PM_DIAG_NO_GATHER=1 PM_DIAG_NO_MMA=1
