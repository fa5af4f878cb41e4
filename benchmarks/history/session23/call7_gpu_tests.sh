# Session 23, call 7 (H200): GPU tests of the restructured weight-gradient kernel (one item
# loop for one CTA per item and persistent CTAs): the new persistent-vs-one-CTA test, and the
# backward tests that run the default weight gradients.
PYTHONPATH=. timeout 330 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "weight_grad_persistent or backward_cp_async or backward_with_empty or (test_mosaic_matches_xla and 0-True-topk)" 2>&1 | tee $OUT/gpu_tests.txt | tail -6
