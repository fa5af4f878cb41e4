# Session 26, call 6. (1) Issue 13: the L2 read bandwidth that bounds the SmoothQuant CSR
# kernel's smooth-scale row reads (l2_probe.py). (2) Issue 15: S = 4 split up tasks at T = 1
# a third time, the variants in the opposite order (call 2: 1.065x; call 5: 0.93x).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 120 python3 benchmarks/history/session26/l2_probe.py 2>&1 | tail -14
timeout 200 python3 benchmarks/decode.py --out $OUT --tokens 1 \
  --variants static_split4,static,kernels 2>&1 | grep "^|"
