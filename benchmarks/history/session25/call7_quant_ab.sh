# Session 25, call 7 (H200, the budget's last ~240 s): the SmoothQuant CSR kernel with each
# load's address loaded a row earlier, against session 24's (issue 13's 0.8-of-copy target),
# then the kernel's GPU tests against numpy.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 130 python3 benchmarks/history/session25/quant_ab.py $OUT 7b,30b 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -12
timeout 60 python3 -m pytest -p no:xdist -q -m gpu tests/test_quant.py -k "test_mosaic_kernel_matches_numpy_on_gpu" 2>&1 | tail -2
