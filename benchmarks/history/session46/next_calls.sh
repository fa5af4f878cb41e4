# Session 46's plan for the next GPU session (no GPU was lent in session 46):
# `bash benchmarks/history/session46/next_calls.sh PART` from the repo root; each part < 10 min,
# logs under $OUT. A fresh machine compiles every kernel (~40 s per GPU test), so the test
# parts are narrow. Fire each call as the last returns (the machine goes back after 30 s idle).
# In this order:
#   S (any card, first): dH's split-M items (session 46, opt-in): ptxas's registers and
#   spills, the GPU bitwise test at 7B and 30B widths, then the backward sweep at 7B and 30B;
#   adopt split-M in `BackwardConfig.for_shape` where it wins by more than its spread;
#   then session 45's plan: U on an H100 (the split-M up-proj at the widths session 45 adopted
#   it for by analogy, and the forward's bound ratios), G (dH's 30B-width bitwise test, the
#   quant GPU tests), R (the decode GPU tests), F (the fp8 GPU tests).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-S}
if [ "$PART" = auto ]; then  # a call that may land on either card: U on an H100, G on an H200
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then PART=U; else PART=G; fi
  echo "auto -> part $PART"
fi
case "$PART" in
S)
  # Issue 9: dH split-M (`DHConfig.split_m`). First ptxas's verdict on the [64, 256] f32
  # accumulator beside the dSwiGLU chunk (the removed ping-pong dH spilled), from the lowering
  # the GPU test compiles; then the bitwise test (a hang shows up as the timeout here, before
  # the benchmark); then the sweep, paired over 3 rounds.
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/ptxas timeout 230 python3 -m pytest \
    -p no:xdist -q -m gpu tests/test_gpu.py -k "dh_split_m_writes and (7b_widths or 30b_widths)" \
    > $OUT/gpu_split.log 2>&1
  echo "gpu split rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_split.log
  grep -rh "moe_dh\|Used [0-9]* registers\|spill" $OUT/ptxas 2>/dev/null | sort | uniq -c | head -20
  if grep -q " passed" $OUT/gpu_split.log && ! grep -q "failed" $OUT/gpu_split.log; then
    timeout 330 python3 benchmarks/backward.py --shapes 7b,30b --sweep splitm --rounds 3 \
      --out $OUT/bw > $OUT/backward.log 2>&1
    echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
    grep "dH\|^|" $OUT/backward.log | cut -c1-220 | tail -24
  fi ;;
U)
  # Issue 16 on the H100. Session 45 made the split-M up-proj every card's default for
  # 1536 < d <= 4096 on one H100 shape (30B: 1.159x over the cooperative kernel). Check the
  # other widths it now covers (the H200 measured d = 2048 1.11x, d = 2880 1.27x): if one
  # loses by > 2%, restrict the H100's rule in `ForwardConfig.for_shape` to where it won.
  timeout 260 python3 benchmarks/forward.py --shapes qwen3-30b-a3b,w2880,30b-n1024 --skew '' \
    --up-sweep cards --down-sweep none --no-baselines --rounds 3 --out $OUT/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep "^  up \|^==" $OUT/forward.log | sed 's/UpProjConfig(.*fused_gate_up=[A-Za-z]*)//' | cut -c1-200
  # Issue 16's ratios on today's defaults: up, down and the whole forward against the dense
  # bound and ragged_dot_mgpu, same run.
  timeout 250 python3 benchmarks/forward.py --shapes 7b,30b --skew 7b --up-sweep none \
    --down-sweep none --out $OUT/fw2 > $OUT/forward2.log 2>&1
  echo "forward2 rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/forward2.log | cut -c1-260 | tail -8 ;;
G)
  # dH's bitwise test at the 30B widths (session 45 fixed the test and ran the other two
  # widths), then the quant kernel's GPU tests on the H100 (issue 13: "pass on the H100").
  timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "dh_configs_write_the_same_bits and 30b_widths" > $OUT/gpu_dh.log 2>&1
  echo "gpu dH rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_dh.log
  timeout 350 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py tests/test_quant_int8.py \
    > $OUT/gpu_quant.log 2>&1
  echo "gpu quant rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 $OUT/gpu_quant.log ;;
F)
  # The fp8 forward's GPU tests (issue 13).
  timeout 560 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant_fp8.py > $OUT/gpu_fp8.log 2>&1
  echo "gpu fp8 rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 $OUT/gpu_fp8.log ;;
R)
  # The decode GPU tests session 44 did not reach (it ran every `test_matches_xla` case).
  timeout 560 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu_decode.py \
    tests/test_kernels_decode.py -k "not test_matches_xla" > $OUT/gpu_decode.log 2>&1
  echo "gpu decode rc=$? at $(( $(date +%s) - T0 )) s"; tail -5 $OUT/gpu_decode.log ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
