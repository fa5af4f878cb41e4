# Session 13, device call 6 (issue 9): dH's default and its no-epilogue ablation at d = 768,
# 1536, 3072 (7B widths): fixed cost and K-loop slope with and without the epilogue.
export PYTHONPATH=. PYTHONUNBUFFERED=1
git apply benchmarks/history/session13/dh_ablation.patch || exit 1
timeout 400 python3 benchmarks/history/session13/dh_ablation.py 7b_d768,7b,7b_d3072 "default,none of the three" > $OUT/dh_ablation_d.txt 2>&1; echo "rc $?"
sed -n '/^| shape/,$p' $OUT/dh_ablation_d.txt; tail -2 $OUT/dh_ablation_d.txt
