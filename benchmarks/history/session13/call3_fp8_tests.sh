# Session 13, device call 3: the fp8 forward's GPU tests (A is now re-quantized by the
# row-block kernel): every step against its reference, the whole forward against XLA and bf16.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 560 python3 -m pytest -p no:xdist -m gpu tests/test_quant_fp8.py -k forward_on_gpu -q -rA \
  > $OUT/gpu_fp8_forward.txt 2>&1; echo "fp8 forward tests rc $?"; tail -6 $OUT/gpu_fp8_forward.txt
