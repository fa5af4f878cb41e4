# Session 50's GPU plan: `bash benchmarks/history/session50/next_calls.sh PART` from the repo
# root; logs under $OUT.
#   V (an H100; after clusters became the split-M up-proj's default from d = 2880): the
#     cluster GPU bitwise tests (the new default against single CTAs), the forward table at
#     30B and gpt-oss widths with the new default (bmm bound, ragged_dot_mgpu), the cluster
#     sweep at d = 2880 with 128-column items (w2880: inside the new rule, not measured
#     before), and dX~ on clusters at 30B (`backward.py --sweep cluster`).
# For the next GPU session, in this order:
#   B (an H100): the expert-bias gradients as dense products (session 50, not yet run on a
#     GPU) against the previous row-tile scan (`benchmarks/bias_grads.py`, paired), then
#     gpt-oss-20b's step with them against the scan (`scan-bias`, paired).
#   H (an H100): dH and the weight gradients on clusters of two CTAs sharing each W2 tile
#     or contiguous K-block (`DHConfig.cluster_m=2`, `WeightGradConfig.cluster_m=2`, never
#     run on a GPU yet): first their GPU bitwise tests (if one fails or hangs, stop there),
#     then `backward.py --sweep cluster` at 30B, 7B and gpt-oss widths (dH, dW2, dW1 and dX~:
#     default against clusters; gpt-oss has no weight-gradient clusters: odd tile counts).
#   S (only if H found clusters faster): the 30B and 7B steps with `cluster-dh` and
#     `cluster-wg` against the default, paired.
#   G (an H100): the down-proj and dX~ with split-M items of 192 rows, three consumers
#     (`GroupedMatmulConfig(block_m=192)`, not yet run on a GPU) at gpt-oss widths: the GPU
#     bitwise test, then the down-proj and dX~ sweeps (paired against the default), then the
#     gpt-oss step with `split-m-192-gemm` if either won.
#   N (any card, when time is left): where the 30B up-proj's warps wait (Nsight Compute's
#     stall samples per SASS instruction, `benchmarks/ncu_source.py`): session 50 ruled out
#     L2 -> SMEM bytes as its main limit (clusters cut them by a third for 3-6%).
export PYTHONPATH=. PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
PART=${1:-V}
case "$PART" in
V)
  timeout 130 python3 -m pytest -p no:xdist -q -x -m gpu tests/test_gpu.py \
    -k "up_proj_cluster_split_m" > $OUT/gpu_cluster.log 2>&1
  echo "gpu cluster rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/gpu_cluster.log
  timeout 140 python3 benchmarks/forward.py --shapes 30b,gpt-oss-20b --skew '' \
    --up-sweep none --down-sweep none --rounds 3 --out $OUT/fw > $OUT/forward.log 2>&1
  echo "forward rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/forward.log | cut -c1-260 | tail -4
  timeout 90 python3 benchmarks/forward.py --shapes w2880 --skew '' --up-sweep cluster \
    --down-sweep none --no-baselines --rounds 3 --out $OUT/fw2880 > $OUT/forward2880.log 2>&1
  echo "w2880 rc=$? at $(( $(date +%s) - T0 )) s"
  grep "^  up " $OUT/forward2880.log | sed 's/UpProjConfig(\(.\{0,40\}\).*cluster_m=\(.\)).*: /UP(\1 cl=\2) /' | cut -c1-200
  timeout 190 python3 benchmarks/backward.py --shapes 30b --sweep cluster --rounds 3 \
    --out $OUT/bw > $OUT/bw.log 2>&1
  echo "backward rc=$? at $(( $(date +%s) - T0 )) s"; grep "  dX~ \\|^|" $OUT/bw.log | cut -c1-230 ;;
B)
  timeout 150 python3 benchmarks/bias_grads.py --shapes gpt-oss-20b,30b --rounds 3 \
    --out $OUT/bias > $OUT/bias.log 2>&1
  echo "bias grads rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|rel err" $OUT/bias.log
  timeout 220 python3 benchmarks/step.py --shapes gpt-oss-20b --gpt-oss \
    --variants topk/cp_async,topk/cp_async/scan-bias --rounds 3 --out $OUT/step_oss \
    > $OUT/step_oss.log 2>&1
  echo "step gpt-oss rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|\|kernels" $OUT/step_oss.log | cut -c1-300 | tail -6 ;;
H)
  timeout 240 python3 -m pytest -p no:xdist -q -x -m gpu tests/test_gpu.py \
    -k "dh_clusters or weight_grad_clusters" > $OUT/gpu_dh_cluster.log 2>&1
  rc=$?; echo "gpu dh cluster rc=$rc at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_dh_cluster.log
  if [ $rc -eq 0 ]; then
    timeout 330 python3 benchmarks/backward.py --shapes 30b,7b,gpt-oss-20b --sweep cluster \
      --rounds 3 --out $OUT/bw > $OUT/bw.log 2>&1
    echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
    grep "  dH \|  dW\|  dX~ \|^|" $OUT/bw.log | sed 's/Config(.*cluster_m=\(.\)).*: /(cl=\1) /' \
      | cut -c1-230
  fi ;;
S)
  timeout 560 python3 benchmarks/step.py --shapes 30b,7b \
    --variants topk/cp_async,topk/cp_async/cluster-dh,topk/cp_async/cluster-wg --rounds 3 --out $OUT/step > $OUT/step.log 2>&1
  echo "step rc=$? at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/step.log | tail -5 ;;
G)
  timeout 200 python3 -m pytest -p no:xdist -q -x -m gpu tests/test_gpu.py \
    -k "192_row_split_m_writes" > $OUT/gpu_gemm192.log 2>&1
  rc=$?; echo "gpu gemm 192 rc=$rc at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/gpu_gemm192.log
  if [ $rc -eq 0 ]; then
    timeout 150 python3 benchmarks/forward.py --shapes gpt-oss-20b,w2880 --skew '' \
      --up-sweep none --down-sweep rows --no-baselines --rounds 3 --out $OUT/fw > $OUT/fw.log 2>&1
    echo "forward rc=$? at $(( $(date +%s) - T0 )) s"
    grep "^  down " $OUT/fw.log | sed 's/GroupedMatmulConfig(block_m=\([0-9]*\).*: /GG(bm=\1) /' | cut -c1-200
    timeout 200 python3 benchmarks/backward.py --shapes gpt-oss-20b --sweep rows --rounds 3 \
      --out $OUT/bw > $OUT/bw.log 2>&1
    echo "backward rc=$? at $(( $(date +%s) - T0 )) s"
    grep "  dX~ " $OUT/bw.log | sed 's/GroupedMatmulConfig(block_m=\([0-9]*\).*: /GG(bm=\1) /' | cut -c1-200
  fi ;;
N)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 420 ncu --clock-control none \
    --section WarpStateStats --section SourceCounters --kernel-name regex:moe_up_proj \
    --launch-skip 1 --launch-count 1 -o $OUT/up30b python3 benchmarks/timeline.py --run-only \
    --out $OUT/t --shapes 30b --kernels up > $OUT/ncu.log 2>&1
  echo "ncu rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/ncu.log
  ncu -i $OUT/up30b.ncu-rep --page source --csv --print-source sass > $OUT/up30b.csv 2>&1
  python3 benchmarks/ncu_source.py $OUT/up30b.csv > $OUT/up30b_stalls.txt 2>&1
  head -40 $OUT/up30b_stalls.txt ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
