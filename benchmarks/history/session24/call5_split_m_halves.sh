# Session 24, call 5: persistent split-M on W1's halves (two N = 128 wgmmas per consumer and
# step, no interleaved W1, so the op can run it without a layout change) against fused on
# interleaved W1 and today's default at 7B, 30B and the Qwen3 widths; then the GPU equality
# test, each case on its own with its output kept (call 4's run stopped at its timeout
# during the 4th case).
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c "
from benchmarks.forward import SHAPES, dense_bound_ms
for s in ('7b', '30b', 'qwen3-30b-a3b'):
    print('dense bound', s, '%.1f us' % (dense_bound_ms(SHAPES[s])[0] * 1e3))
" 2>&1 | grep "dense bound" | tee $OUT/dense.txt
H=up_pingpong+block_m=128+num_stages=4
F=up_pingpong+block_m=128+fused+interleaved+num_stages=4
timeout 400 python3 benchmarks/timeline.py --plain --out $OUT/t --shapes 7b,30b,qwen3-30b-a3b --kernels up,$H,$F \
 2>&1 | grep "^|" | tee $OUT/t.txt
timeout 180 python3 -m pytest -p no:xdist -v -m gpu tests/test_gpu.py -k "test_up_proj_pingpong_equals_cooperative" -x > $OUT/gpu_tests.txt 2>&1
grep -E "PASS|FAIL|Error|error|passed|failed" $OUT/gpu_tests.txt | tail -8
