# Session 26, call 1 (issue 9): the 7B step's GPU idle between kernels and the router add.
# Session 25: GPU kernel time 3.245-3.253 ms, pipelined 3.62-3.66 ms/step: ~0.4 ms (12%) of
# idle a training loop sees. `step.py --gaps` traces 5 back-to-back steps and sums the idle
# per (kernel before, kernel after). The same step under XLA command-buffer settings: do CUDA
# graphs capture the Mosaic custom calls and the ~45 small XLA kernels?
export PYTHONPATH=. PYTHONUNBUFFERED=1
XLA_FLAGS=--helpfull timeout 30 python3 -c "import jax; jax.devices()" 2>&1 | grep -i "command_buffer\|graph_min\|graph_level" | head -8
i=0
for flags in "" \
  "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,COLLECTIVES --xla_gpu_graph_min_graph_size=1" \
  "--xla_gpu_enable_command_buffer="; do
  echo "== XLA_FLAGS=$flags"
  XLA_FLAGS="$flags" timeout 140 python3 benchmarks/step.py --out $OUT/gaps$i --shapes 7b \
    --variants topk/cp_async --gaps 2>&1 | grep "^| 7b\|gaps:\|kernels (ms\|Error\|error" | cut -c1-1500
  i=$((i+1))
done
timeout 100 python3 benchmarks/history/session25/add_fusion.py 2>&1 | grep "^|"
