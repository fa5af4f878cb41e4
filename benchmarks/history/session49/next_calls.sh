# Session 49's GPU plan: `bash benchmarks/history/session49/next_calls.sh PART` from the repo
# root; each part < 10 min, logs under $OUT.
#   W (an H100): gpt-oss-20b with the weight gradients' new three-consumer default: the
#     step against the consumers before (paired), the backward's kernel table, and the
#     weight gradients' GPU bitwise test at gpt-oss widths.
#   R (an H100): split-M up-proj items of 192 rows (three consumers sharing each weight
#     tile) against 128-row items at gpt-oss, Qwen3, d = 2880 and 30B widths; then the
#     gpt-oss step with them (paired against the default).
#   T (any card; after 192-row items became gpt-oss's default): their GPU bitwise test, and
#     gpt-oss's forward table (bound ratios, ragged_dot_mgpu).
# For the next GPU session, in this order:
#   C (an H100): clusters of two CTAs sharing each weight tile by multicast (`cluster_m=2`,
#     never run on a GPU yet) in the up-proj's split-M items and in the grouped GEMM (the
#     down-proj, dX~): first their GPU bitwise tests (if one fails or hangs, stop there),
#     then the forward sweep at 30B, 7B, gpt-oss, Qwen3 and d = 7168 (up-proj: default vs
#     split-M vs split-M on clusters; down-proj: default vs clusters).
#   C2: dX~ on clusters (`backward.py --sweep cluster`) at 30B, 7B and gpt-oss.
#   D: the 30B and 7B steps with `cluster-up` (the up-proj) and `cluster-gemm` (down-proj
#     and dX~) against the default, paired (only if C / C2 found clusters faster there).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-W}
case "$PART" in
W)
  timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
    -k "weight_grad_persistent and gpt_oss" > $OUT/gpu_wg.log 2>&1
  echo "gpu wg rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_wg.log
  timeout 200 python3 benchmarks/step.py --shapes gpt-oss-20b --gpt-oss \
    --variants topk/cp_async,topk/cp_async/fewer-consumer-wg --rounds 3 --out $OUT/step_oss \
    > $OUT/step_oss.log 2>&1
  echo "step gpt-oss rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step_oss.log | tail -4
  timeout 150 python3 benchmarks/backward.py --shapes gpt-oss-20b --rounds 3 --out $OUT/bw \
    > $OUT/bw.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/bw.log | cut -c1-260 ;;
R)
  timeout 380 python3 benchmarks/forward.py --shapes gpt-oss-20b,qwen3-30b-a3b,w2880,30b \
    --skew '' --up-sweep rows --down-sweep none --no-baselines --rounds 3 \
    --out $OUT/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
  grep "^  up \|^==\|errors\|FAIL\|Error" $OUT/forward.log | sed 's/UpProjConfig(\(.\{0,100\}\).*): /UP(\1) /' | cut -c1-230
  timeout 170 python3 benchmarks/step.py --shapes gpt-oss-20b --gpt-oss \
    --variants topk/cp_async,topk/cp_async/split-m-192-up --rounds 3 --out $OUT/step_oss \
    > $OUT/step_oss.log 2>&1
  echo "step gpt-oss rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step_oss.log | tail -4 ;;
T)
  timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "192_row" \
    > $OUT/gpu_up.log 2>&1
  echo "gpu up rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_up.log
  timeout 200 python3 benchmarks/forward.py --shapes gpt-oss-20b --skew '' --up-sweep none \
    --down-sweep none --rounds 3 --out $OUT/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/forward.log | cut -c1-260 | tail -3 ;;
C)
  timeout 300 python3 -m pytest -p no:xdist -q -x -m gpu tests/test_gpu.py -k "cluster" \
    > $OUT/gpu_cluster.log 2>&1
  rc=$?; echo "gpu cluster rc=$rc at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_cluster.log
  if [ $rc -eq 0 ]; then
    timeout 280 python3 benchmarks/forward.py --shapes 30b,7b,gpt-oss-20b,qwen3-30b-a3b,w7168 \
      --skew '' --up-sweep cluster --down-sweep cluster --no-baselines --rounds 3 --out $OUT/fw \
      > $OUT/forward.log 2>&1
    echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
    grep "^  up \|^  down \|^==\|errors\|FAIL\|Error" $OUT/forward.log | sed 's/UpProjConfig(\(.\{0,100\}\).*cluster_m=\(.\)).*: /UP(\1 cl=\2) /' | sed 's/fp8_promote_every.*out_buffers=., //' | cut -c1-230
  fi ;;
C2)
  timeout 500 python3 benchmarks/backward.py --shapes 30b,7b,gpt-oss-20b --sweep cluster \
    --rounds 3 --out $OUT/bw > $OUT/bw.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; grep "  dX~ \\|^|" $OUT/bw.log | cut -c1-260 ;;
D)
  timeout 560 python3 benchmarks/step.py --shapes 30b,7b \
    --variants topk/cp_async,topk/cp_async/cluster-up,topk/cp_async/cluster-gemm \
    --rounds 3 --out $OUT/step > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step.log | tail -6 ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
