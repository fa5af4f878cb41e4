# Session 26, call 3 (issue 13; planned in session 25): the SmoothQuant CSR kernel's remaining latency.
# Call 7 of session 25 confirmed that the per-row chain of dependent loads was the limit
# (expert id -> scale row: 1.07-1.11x once the id came a row earlier). Next: scale rows 2 or
# 3 rows ahead (`SmoothQuantConfig.scale_rows_ahead`; d / 128 more registers per thread each:
# 12 at 7B, 32 at 30B) and two tokens per CTA (the next token's X row and CSR bounds
# prefetched; its first scale row is not), against session 24's kernel and call 7's, same run.
# `fadd` rounds int8 by an f32 add of 1.5 * 2^23 (full-rate FP32 pipe) instead of
# `cvt.rni.sat.s8.f32` (the quarter-rate conversion pipe: ~0.26 ms of issue at 30B if it
# were the only work); the same bits for every finite row (checked in numpy: only +-127.5
# differ, which v = y * rcp(s) never reaches). Then the kernel's GPU tests against numpy
# (they include "fadd", `test_mosaic_kernel_matches_numpy_on_gpu`); if both hold, make the
# fastest the default.
export PYTHONPATH=. PYTHONUNBUFFERED=1
QUANT_AB_VERSIONS=s24,cur,fadd,ahead2,ahead3,bt2,ahead2_bt2 timeout 300 \
  python3 benchmarks/history/session25/quant_ab.py $OUT 7b,30b 2>&1 | grep "^|"
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "on_gpu" 2>&1 | tail -2  # includes the unsmoothed loop (several rows per token)
