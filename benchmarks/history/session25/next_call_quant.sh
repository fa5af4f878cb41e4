# Planned for the next session (issue 13): the SmoothQuant CSR kernel's remaining latency.
# Call 7 of session 25 confirmed that the per-row chain of dependent loads was the limit
# (expert id -> scale row: 1.07-1.11x once the id came a row earlier). Next: scale rows 2 or
# 3 rows ahead (`SmoothQuantConfig.scale_rows_ahead`; d / 128 more registers per thread each:
# 12 at 7B, 32 at 30B) and two tokens per CTA (the next token's X row and CSR bounds
# prefetched; its first scale row is not), against session 24's kernel and today's, same run.
export PYTHONPATH=. PYTHONUNBUFFERED=1
QUANT_AB_VERSIONS=s24,cur,ahead2,ahead3,bt2,ahead2_bt2 timeout 300 \
  python3 benchmarks/history/session25/quant_ab.py $OUT 7b,30b 2>&1 | grep "^|"
