# Session 12, device call 2: the decode megakernel's untested block/loader variants at the
# Qwen3-30B-A3B widths, then the two exact-exp cases of test_mosaic_matches_xla.
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT/decode
timeout 360 python3 benchmarks/decode.py --out $OUT/decode --tokens 1,8,128,1024 \
  --variants kernels,kernels_inf,static,static_s5,static_s6,static_tma,static_exact,static_regs \
  > $OUT/decode_stdout.txt 2>&1; echo "decode rc $?"
timeout 200 python3 -m pytest -p no:xdist -m gpu tests/test_gpu.py -k "mosaic_matches_xla and 2-False" -q -rA \
  > $OUT/gpu_matches_xla_exact.txt 2>&1; echo "test_gpu rc $?"; tail -3 $OUT/gpu_matches_xla_exact.txt
tail -12 $OUT/decode/decode_RESULTS.md
