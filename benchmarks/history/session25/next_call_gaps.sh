# Planned for the next session (issue 9, ~240 s): the 7B step's GPU idle between kernels.
# Session 25's call 1: GPU kernel time 3.245-3.253 ms, pipelined (10 steps back to back)
# 3.62-3.66 ms, so ~0.4 ms per step of idle that a training loop sees. Are XLA's command
# buffers (CUDA graphs) capturing the Mosaic custom calls and the ~45 small XLA kernels?
# Same step under command-buffer settings; compare `pipelined ms/step` (and `step wall`).
export PYTHONPATH=. PYTHONUNBUFFERED=1
for flags in "" \
  "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  "--xla_gpu_enable_command_buffer="; do
  echo "== XLA_FLAGS=$flags"
  XLA_FLAGS="$flags" timeout 110 python3 benchmarks/step.py --out $OUT/gaps --shapes 7b \
    --variants topk/cp_async 2>&1 | grep "^| 7b"
done
