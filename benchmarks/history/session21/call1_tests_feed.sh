# Session 21, call 1: session 20's owed GPU re-run of the ping-pong up-proj (its K loops became
# one function after the last GPU call), then the feed ablation: are the ping-pong up-proj's
# and the persistent dH's K loops bound by the bytes moved from L2 into SMEM per FLOP?
# (`timeline.py` `halfweights`: the weight stages move half their bytes; timing only.)
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 260 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "pingpong or (test_mosaic_matches_xla and 0-True-topk)" 2>&1 | tail -15 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
timeout 300 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels up_pingpong,up_pingpong+halfweights,up_pingpong+noepilogue,up_pingpong+noepilogue+halfweights,up_coop+noepilogue,up_coop+noepilogue+halfweights,dh,dh_halfweights,dh_noepilogue,dh_noepilogue+halfweights,up_pingpong 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -16
