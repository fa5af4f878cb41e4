# Session 27, call 8 (issues 16 and 9): calls 1-2 sampled the gathering K loops per SASS
# instruction. The up-proj's producer spends ~37% of its samples on the IMAD that writes a
# cp.async's address registers (long-scoreboard: the previous LDGSTS still reads them) and
# ~19% on the dummy LDS ptxas puts after it; dW1's producer waits ~30 cycles per row on the
# SMEM id load just before each address. New: `_common._cp_async_rows` loads every pass's id
# and computes its address before the first copy. Same run, CUPTI us: the 7B up-proj default
# (ping-pong) and the split-M persistent kernel, the 30B up-proj, the 7B dH, both 7B weight
# gradients (bitwise check), each with the ids inline (as before) and first. Then the GPU
# tests of the cp.async gathers and the quant kernel's final form.
# Ran at commit b742280: timeline.py's `inlineids` variant was removed after it.
export PYTHONPATH=. PYTHONUNBUFFERED=1
P=up_pingpong+block_m=128+fused+interleaved+num_stages=4
timeout 200 python3 benchmarks/timeline.py --plain --out /tmp/t7 --shapes 7b --kernels \
  up_inlineids,up,$P+inlineids,$P,dh_inlineids,dh 2>&1 | grep "^|" | tee $OUT/t7.txt
timeout 100 python3 benchmarks/history/session27/gather_order.py 7b 2>&1 | grep "^|" | tee $OUT/wg7.txt
timeout 120 python3 benchmarks/timeline.py --plain --out /tmp/t30 --shapes 30b --kernels \
  up_inlineids,up 2>&1 | grep "^|" | tee $OUT/t30.txt
timeout 150 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
  -k "test_up_proj_cp_async_gather_matches_reference or test_backward_cp_async_matches_reference" 2>&1 | tail -2
