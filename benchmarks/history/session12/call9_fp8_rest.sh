export PYTHONPATH=. PYTHONUNBUFFERED=1; timeout 280 python3 -m pytest -p no:xdist -m gpu tests/test_quant_fp8.py -q -rA -k "fp8_forward_on_gpu and not topk-per_token" > $OUT/gpu_fp8_rest.txt 2>&1
