# Session 29, call 1: session 28's prepared run (next_call_h200.sh, parts 1 and 1b).
# Paired f32 -> bf16 conversions: the bits of the op both ways, then the kernels that round
# accumulators to bf16 both ways; the SmoothQuant kernel with the next scale row prefetched.
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 170 python3 benchmarks/history/session28/packed_bf16.py 7b,30b 2>&1 | $F | tee $OUT/pb.log | tail -12
timeout 200 python3 benchmarks/timeline.py --plain --out $OUT/pk --shapes 7b,30b --kernels \
  up,up_packedbf16,dh,dh_packedbf16,down,down_packedbf16,dx,dx_packedbf16 2>&1 \
  | tee $OUT/pk.log | grep "^|"
timeout 170 python3 benchmarks/history/session28/quant_prefetch.py $OUT/qp 7b,30b,qwen3 \
  > $OUT/qp_log.txt 2>&1; grep "^|" $OUT/qp_log.txt; grep -E "Error|Traceback" $OUT/qp_log.txt | head -3
