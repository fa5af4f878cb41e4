# Session 31, call 7: issue 13, SmoothQuant's vec at block_t = 1 (call 5: 4 beat 8 by
# 1.03-1.14x where both fit); do 2 or 1 (more, smaller accesses per row) help at 7B and
# d = 7168, the widths still under 0.8 of copy?
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 330 python3 benchmarks/quant.py --out /tmp/q --shapes 7b,d7168,d2048,30b \
  --token-rounding '' > $OUT/quant.log 2>&1
grep "^|" $OUT/quant.log | tail -10; grep "csr SmoothQuantConfig\|^== " $OUT/quant.log \
  | grep "vec=[12])\|vec=None\|^== " | grep -v "block_t=2\|block_pad=256" \
  | sed 's/, scale_rows_ahead=0, int8_rounding=.fadd.//'
