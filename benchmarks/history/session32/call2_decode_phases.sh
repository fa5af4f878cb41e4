# Session 32, call 2 (issue 15): call 1 showed the up phase's W1 reads alone take ~8 us at
# T = 1 in strip or row order alike (63-66 GB/s per SM on 96 CTAs, L2-assisted), while the
# megakernel takes 45 us. Which phase holds the time: the megakernel on each subset of its
# task kinds, metadata precomputed, with up-phase config variants, against the bare stream.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 500 python3 benchmarks/history/session32/decode_phases.py --out $OUT --tokens 1,8 \
  2>&1 | grep -v cuda_event | tail -30
