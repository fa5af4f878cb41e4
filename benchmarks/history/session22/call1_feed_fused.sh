# Session 22, call 1 (issue 16): what bounds the ping-pong up-proj's K loop?
# (a) `nomma`: the feed alone (no wgmma issued); (b) `fused`: one N = 256 wgmma per K step on a
# [64, gate | up] weight tile (UpProjConfig.fused_gate_up, 16 weight TMAs of 8 rows per step)
# instead of two N = 128 wgmmas that each re-read the A stage. Bitwise check of `fused` first.
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_up_proj_pingpong_equals_cooperative" 2>&1 | tail -8 > $OUT/gpu_tests.txt
cat $OUT/gpu.txt $OUT/gpu_tests.txt
timeout 330 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels up_pingpong,up_pingpong+fused,up_pingpong+noepilogue,up_pingpong+fused+noepilogue,up_pingpong+noepilogue+nomma,up_pingpong+fused+noepilogue+nomma,up_coop,up_coop+noepilogue+nomma,dh,dh_nomma,dh_noepilogue,up_pingpong,up_pingpong+fused 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -18
