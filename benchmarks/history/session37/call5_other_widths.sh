# Session 37, call 5 (nvidia-h200, the warm machine's last minutes): the H200's new
# ping-pong down-proj default (one staged slab) at two more widths against the whole tile.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 185 python3 benchmarks/forward.py --shapes qwen3-30b-a3b,7b-n1024 --skew '' --up-sweep none \
  --down-sweep slabs --no-baselines --out /tmp/fw > $OUT/forward_other.log 2>&1
