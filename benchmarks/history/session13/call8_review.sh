# Session 13, device call 8 (review): the row-block quantizer finds a block's experts once per
# block instead of per chunk and pass; its GPU tests and the same-run A/B against the CSR kernel.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -p no:xdist -m gpu tests/test_quant.py -k row_blocks -q -rA > $OUT/gpu_row_blocks.txt 2>&1; echo "tests rc $?"; tail -2 $OUT/gpu_row_blocks.txt
timeout 200 python3 benchmarks/history/session13/requant_ab.py 7b,30b > $OUT/requant_ab.txt 2>&1; echo "ab rc $?"
sed -n '/^| shape | smoothed/,$p' $OUT/requant_ab.txt | grep -E "csr|default|264ctas st1|smoothed \|"
