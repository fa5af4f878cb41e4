# Session 25, call 3 (H200): the whole training step on the H200's new defaults (the
# persistent split-M up-proj since session 24, the persistent 4-stage weight gradients since
# session 25) against session 24's start (cooperative up-proj, one CTA per weight-gradient
# item) at 30B and the Qwen3 widths; then the 7B step with XLA's Triton GEMM fusion off,
# which in call 2 let XLA fold an add into the cuBLAS GEMM (beta = 1): does it fold the
# router's dx into the MoE's dX there (the 56-us `wrapped_add`)?
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
timeout 420 python3 benchmarks/step.py --out $OUT/wide --shapes 30b,qwen3-30b-a3b \
  --variants topk/cp_async,topk/cp_async/cooperative-up/one-cta-wg 2>&1 | $F | grep "^|\|kernels" | tail -8
XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" timeout 110 python3 benchmarks/step.py \
  --out $OUT/no_triton_gemm --shapes 7b --variants topk/cp_async 2>&1 | $F | grep "^|\|kernels" | tail -3
