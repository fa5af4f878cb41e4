# Session 45's plan for the next GPU session: `bash benchmarks/history/session45/next_calls.sh PART`
# from the repo root; each part < 10 min, logs under $OUT. A fresh machine compiles every kernel
# (~40 s per GPU test), so the test parts are narrow. Fire each call as the last returns (the
# machine goes back after 30 s idle). In this order:
#   on an H100: U (the split-M up-proj at the widths session 45 adopted it for by analogy,
#   then the forward's bound ratios on today's defaults);
#   on any card: G (dH's 30B-width bitwise test, the quant GPU tests), then R (the decode GPU
#   tests session 44 did not reach).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-U}
if [ "$PART" = auto ]; then  # a call that may land on either card: U on an H100, G on an H200
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then PART=U; else PART=G; fi
  echo "auto -> part $PART"
fi
case "$PART" in
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
