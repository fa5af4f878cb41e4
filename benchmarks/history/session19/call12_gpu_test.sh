# Call 12: the scoped grouped-GEMM engine (down-proj, dX~) inside the whole forward and backward
export PYTHONPATH=. PYTHONUNBUFFERED=1; timeout 230 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_mosaic_matches_xla and 0-True-topk" 2>&1 | tail -3
