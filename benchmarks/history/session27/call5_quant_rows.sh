# Session 27, call 5 (issue 13): call 4 put the 30B gain in the TILED [1, d] row form (R = 1
# group: 510.9 / 522.6 us against 540-560 for the WG_STRIDED loop in either semantics and
# either prefetch distance), and the 7B gain in no auto barriers with the next scale row
# held (144.3 us). The kept kernel: TILED rows, Lane semantics, no auto barriers, scale rows
# 1 ahead up to d = 2048 and 0 above. Same run against session 26's kernel (a copy), with
# both prefetch distances and two tokens per CTA at both widths, plus the Qwen3 width
# (d = 2048, the default's edge). Then the GPU tests of every quant kernel and the fp8/int8
# forwards (their A's SmoothQuant runs through this kernel).
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 330 python3 benchmarks/history/session27/quant_groups.py $OUT 7b,30b,qwen3 > $OUT/ab_log.txt 2>&1
grep "^|" $OUT/ab_log.txt; grep -E "Error|Traceback" $OUT/ab_log.txt | head -5
timeout 120 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py 2>&1 | tail -2
timeout 200 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant_fp8.py tests/test_quant_int8.py -k "forward_on_gpu and not token" 2>&1 | tail -2
