# Session 12, device call 1: GPU tests of the approx_math default (test_gpu.py's
# mosaic_matches_xla: default configs = ex2.approx, seed 2 = exact) and the decode
# megakernel's GPU suite (its up tasks now take ex2.approx too).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 300 python3 -m pytest -p no:xdist -m gpu tests/test_gpu.py -k mosaic_matches_xla -q -rA \
  > $OUT/gpu_matches_xla.txt 2>&1; echo "test_gpu rc $?"; tail -3 $OUT/gpu_matches_xla.txt
timeout 270 python3 -m pytest -p no:xdist -m gpu tests/test_gpu_decode.py -q -rA \
  > $OUT/gpu_decode.txt 2>&1; echo "test_gpu_decode rc $?"; tail -3 $OUT/gpu_decode.txt
