# Session 13, device call 7 (issue 16): the up-proj's epilogue ablation and d sweep (as dH's,
# call 5-6). Applies the ablation patch on the device only.
export PYTHONPATH=. PYTHONUNBUFFERED=1
git apply benchmarks/history/session13/up_ablation.patch || exit 1
timeout 500 python3 benchmarks/history/session13/up_ablation.py 7b,7b_d768,7b_d3072,30b > $OUT/up_ablation.txt 2>&1; echo "rc $?"
sed -n '/^| shape/,$p' $OUT/up_ablation.txt; tail -2 $OUT/up_ablation.txt
