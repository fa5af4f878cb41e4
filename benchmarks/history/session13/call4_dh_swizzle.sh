# Session 13, device call 4 (issue 9): dH's epilogue tiles as swizzled slabs against the
# untiled default (bitwise on poisoned outputs, CUPTI time), then the 7B step with it.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 330 python3 benchmarks/history/session13/dh_swizzle.py 7b,30b > $OUT/dh_swizzle.txt 2>&1; echo "dh rc $?"
sed -n '/^| shape/,$p' $OUT/dh_swizzle.txt
