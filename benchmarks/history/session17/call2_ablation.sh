# Ran on commit e4eceda (fused_gate_up with its 8-row loader, before the 5-D TMA): loader_ablation.patch applies there, not on main or on fused_gate_up_experiment.patch.
# The fused gate/up up-proj against the same split-M tiles whose weights also come as
# 8-row boxes (loader_ablation.patch, device only): separates the loader from the wgmma.
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
git apply benchmarks/history/session17/loader_ablation.patch
mkdir -p $OUT/fwd
timeout 120 python3 benchmarks/history/session17/fused_bitwise.py 7b 2>&1 | grep -v "^I0000\|^W0000" > $OUT/ablation_bitwise.txt
timeout 400 python3 benchmarks/forward.py --shapes 7b,30b --skew "" --up-sweep fused --down-sweep none --no-baselines --out $OUT/fwd 2>&1 | grep -v "^I0000\|^W0000" | tail -40 > $OUT/fwd_stdout.txt
git apply -R benchmarks/history/session17/loader_ablation.patch
cat $OUT/ablation_bitwise.txt | tail -4; grep "  up " $OUT/fwd_stdout.txt | sed 's/lane_semantics.*gather_completion=/ /; s/epilogue_slabs.*fused/fused/'
