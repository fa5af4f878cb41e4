# Session 26, call 7 (issue 13): smooth-scale rows staged in SMEM by TMA
# (`SmoothQuantConfig.scale_stages`, built this session) against the default, same run, with
# ptxas's register counts (MOSAIC_GPU_DUMP_PTXAS); then the kernel's GPU tests (now with
# the staged configs). Prediction: 1.05-1.2x if rows in flight per SM were the limit.
export PYTHONPATH=. PYTHONUNBUFFERED=1
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/ptxas timeout 240 \
  python3 benchmarks/history/session26/quant_smem.py $OUT 7b,30b 2>&1 | grep "^|"
grep -rh "Used [0-9]* registers" $OUT/ptxas 2>/dev/null | sort | uniq -c | head -20
ls $OUT/ptxas 2>/dev/null | head -5; ls $OUT/ptxas 2>/dev/null | wc -l
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "on_gpu" 2>&1 | tail -3
