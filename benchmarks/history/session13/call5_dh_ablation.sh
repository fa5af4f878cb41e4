# Session 13, device call 5 (issue 9): where dH's time outside its K loop goes. Applies the
# ablation patch on the device only (the library stays as committed).
export PYTHONPATH=. PYTHONUNBUFFERED=1
git apply benchmarks/history/session13/dh_ablation.patch || exit 1
timeout 400 python3 benchmarks/history/session13/dh_ablation.py 7b,30b > $OUT/dh_ablation.txt 2>&1; echo "rc $?"
sed -n '/^| shape/,$p' $OUT/dh_ablation.txt; tail -3 $OUT/dh_ablation.txt
