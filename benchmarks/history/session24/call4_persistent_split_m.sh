# Session 24, call 4: persistent split-M up-proj tiles (`pingpong_ctas` with block_m=128:
# both consumers take every 128-row item, 64 rows each, one N = 256 wgmma on interleaved W1;
# the producer streams across items). Call 3 (ncu) put the cooperative split-M K loop's
# tensor pipe at 70% against 84% for its wgmmas alone, with SMEM at 55% of peak (dense
# cuBLAS: 69%), so not SMEM bandwidth; what the cooperative kernel pays per CTA is the ring's
# drain and refill (one CTA per tile). Same run: the dense bound, today's default, the
# cooperative split-M kernel, the persistent split-M kernel (K loop alone, full, 3 stages
# with 4 epilogue tiles, lagged publish); 30B default vs persistent split-M. Then the GPU
# equality test (poisoned outputs, bitwise against the cooperative kernel).
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c "
from benchmarks.forward import SHAPES, dense_bound_ms
for s in ('7b', '30b'):
    print('dense bound', s, '%.1f us' % (dense_bound_ms(SHAPES[s])[0] * 1e3))
" 2>&1 | grep "dense bound" | tee $OUT/dense.txt
P=up_pingpong+block_m=128+fused+interleaved+num_stages=4
timeout 330 python3 benchmarks/timeline.py --plain --out $OUT/t7 --shapes 7b --kernels \
up,up_coop+block_m=128+fused+interleaved+num_stages=4+gather_completion=mbarrier,$P,$P+noepilogue,up_pingpong+block_m=128+fused+interleaved+num_stages=3+epilogue_tiles=4,$P+gather_completion=wait_group,up \
 2>&1 | grep "^|" | tee $OUT/t7.txt
timeout 150 python3 benchmarks/timeline.py --plain --out $OUT/t30 --shapes 30b --kernels up,$P \
 2>&1 | grep "^|" | tee $OUT/t30.txt
timeout 240 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k test_up_proj_pingpong_equals_cooperative 2>&1 | tail -4
