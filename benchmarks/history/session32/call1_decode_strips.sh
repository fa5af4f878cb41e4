# Session 32, call 1 (issue 15, T = 1 at 2.0x the weight-read bound): the megakernel's up
# tasks stream W1 at ~21 GB/s per SM where a bare TMA ring reached 28-32 (session 29), but
# that ring read whole rows box after box, while an up task reads its column block's
# 128-byte piece of every 3-KB row, down the K rows (strip order). (1) The up phase alone in
# strip vs row order, same CTAs and bytes (`stream_probe.py --up-phase`), and wider boxes
# with split K; (2) the megakernel at T = 1, 8 with the matching configs, twice in opposite
# orders (small-T noise ~10%).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/smi.txt
timeout 200 python3 benchmarks/stream_probe.py --out $OUT --boxes 64x64,64x128 --stages 5 \
  --up-phase 64:1:5,64:1:8,64:2:5,64:4:5,128:1:3,128:2:3,128:2:4,256:4:2 2>&1 | tail -22
V=kernels,static,static_split2,static_split4,static_u128,static_u128_split2,static_s6,static_tma
R=$(echo $V | tr ',' '\n' | tac | paste -sd,)
for run in 1 2; do
  [ $run = 1 ] && vs=$V || vs=$R
  timeout 220 python3 benchmarks/decode.py --out /tmp/dec$run --tokens 1,8 --variants $vs \
    > $OUT/decode_sweep$run.log 2>&1
  cp /tmp/dec$run/decode_RESULTS.md $OUT/decode_sweep$run.md 2>/dev/null
  grep -E "WRONG|failed" $OUT/decode_sweep$run.log | head -5
  grep "^|" $OUT/decode_sweep$run.md | head -6
done
