# Call 3: the persistent dH's epilogue split (dswiglu chunks: H loads, math, SMEM writes;
# store), with ablations, 7B.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 400 python3 benchmarks/timeline.py --out $OUT --shapes 7b --kernels dh,dh_nomath,dh_nostore,dh_noepilogue 2>&1 | grep -v "^WARNING\|warn" | grep "==\|CUPTI\|fit\|consumer0\|gap\|CTAs"
