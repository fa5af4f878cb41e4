# Session 57's GPU calls: `bash benchmarks/history/session57/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   S (~4 min, H100): issue 9: do dH's epilogue stores wait on each other across SMs? The
#      default dH against CTAs started out of phase (`dh_stagger.py`: stag2, stag4), 7B and
#      30B, 2 rounds paired, bitwise checked on poisoned outputs.
#   W (~5 min, H100): issue 9: dH with its dH / A' stores from registers (`dh_regstore.py`, `DHConfig(store="registers")`:
#      predicated st.global, no wait for TMA stores to leave SMEM) against the default and
#      no_store, 7B and 30B, 2 rounds paired, bitwise checked on poisoned outputs; then its
#      GPU test (bitwise the default at three widths, 132 and 8 CTAs).
#   P (~9 min, H100): issue 9: the ping-pong dH (`DHConfig.pingpong()`, SonicMoE's shape):
#      ptxas registers and spills of its variants at 7B, then `dh_regstore.py` 7B and 30B
#      paired over 2 rounds (default, pp, pp_reg, registers; bitwise dH / A'), then the GPU
#      tests of the ping-pong and of the register stores.
#   R, N, F, D: session 56's R and session 55's N, F, D (`session56/next_calls.sh PART`).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
PART=${1:-S}
case "$PART" in
S)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
  timeout 400 python3 benchmarks/history/session57/dh_stagger.py 7b,30b 2 \
    default,stag2,stag4 > $OUT/dh_stagger.log 2>&1
  echo "dh stagger rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_stagger.log | tail -20
  grep "^|" $OUT/dh_stagger.log ;;
W)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
  timeout 400 python3 benchmarks/history/session57/dh_regstore.py 7b,30b 2 \
    default,registers,no_store > $OUT/dh_regstore.log 2>&1
  echo "dh regstore rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_regstore.log | tail -20
  grep "^|" $OUT/dh_regstore.log
  timeout 120 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_dh_register_stores_write_the_default_bits" > $OUT/gpu_dh_registers.log 2>&1
  echo "gpu dh registers rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_dh_registers.log ;;
W2)  # W cut to ~4 min (the session's last device seconds)
  timeout 200 python3 benchmarks/history/session57/dh_regstore.py 7b,30b 2 \
    default,registers > $OUT/dh_regstore.log 2>&1
  echo "dh regstore rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_regstore.log | tail -14
  grep "^|" $OUT/dh_regstore.log
  timeout 70 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_dh_register_stores_write_the_default_bits and 7b" > $OUT/gpu_dh_registers.log 2>&1
  echo "gpu dh registers rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_dh_registers.log ;;
P)  # the ping-pong dH (~5 min): ptxas registers first, then paired timings, then its GPU test
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 benchmarks/history/session57/dh_regstore.py 7b 1 \
    default,pp,pp_reg,pp64 > $OUT/dh_pp_ptxas.log 2>&1
  echo "ptxas rc=$? at $(( $(date +%s) - T0 )) s"
  grep -i -E "entry function|registers|spill|bytes stack|^== " $OUT/dh_pp_ptxas.log | head -40  # in compile order
  grep "^|" $OUT/dh_pp_ptxas.log
  timeout 260 python3 benchmarks/history/session57/dh_regstore.py 7b,30b 2 \
    default,pp,pp_reg,registers > $OUT/dh_pp.log 2>&1
  echo "dh pp rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "^|" $OUT/dh_pp.log | tail -22
  grep "^|" $OUT/dh_pp.log
  timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_dh_pingpong_writes_the_default_bits or test_dh_register_stores_write" > $OUT/gpu_dh_pp.log 2>&1
  echo "gpu dh pp rc=$? at $(( $(date +%s) - T0 )) s"; tail -4 $OUT/gpu_dh_pp.log ;;
P2)  # P cut to ~4.5 min (the session's last device seconds): ptxas's lines from the timing run
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 230 python3 benchmarks/history/session57/dh_regstore.py \
    7b,30b 1 default,pp,pp_reg > $OUT/dh_pp.log 2>&1
  echo "dh pp rc=$? at $(( $(date +%s) - T0 )) s"
  grep -i -E "entry function|registers|spill|bytes stack|^== " $OUT/dh_pp.log | head -40  # in compile order
  grep -v "^|" $OUT/dh_pp.log | grep -v -i -E "ptxas|registers|spill|bytes stack|^ *$" | tail -16
  grep "^|" $OUT/dh_pp.log
  timeout 60 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k \
    "test_dh_pingpong_writes_the_default_bits and 7b" > $OUT/gpu_dh_pp.log 2>&1
  echo "gpu dh pp rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_dh_pp.log ;;
P3)  # P2 cut to ~3.5 min: 7B first (default, pp, pp_reg), then 30B (default, pp)
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 130 python3 benchmarks/history/session57/dh_regstore.py \
    7b 1 default,pp,pp_reg > $OUT/dh_pp_7b.log 2>&1
  echo "dh pp 7b rc=$? at $(( $(date +%s) - T0 )) s"
  grep -i -E "entry function|registers|spill|bytes stack|^== " $OUT/dh_pp_7b.log | head -24  # in compile order
  grep -E "bitwise|rel err|TFLOP|  (default|pp)" $OUT/dh_pp_7b.log | grep -v -i ptxas | tail -10
  timeout 90 python3 benchmarks/history/session57/dh_regstore.py 30b 1 default,pp \
    > $OUT/dh_pp_30b.log 2>&1
  echo "dh pp 30b rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "bitwise|rel err|TFLOP|  (default|pp)" $OUT/dh_pp_30b.log | tail -8 ;;
*)
  bash benchmarks/history/session56/next_calls.sh "$PART" ;;
esac
echo "session 57 part $PART done in $(( $(date +%s) - T0 )) s"
