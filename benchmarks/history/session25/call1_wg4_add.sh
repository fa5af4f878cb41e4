# Session 25, call 1 (H200): (1) does XLA fold the router's dx into its cuBLAS GEMM (the 7B
# step's 56-us `wrapped_add`)? (2) session 24's owed run: the persistent weight gradients
# with 4 stages beside one output buffer per consumer (`output_chunks=1`), bitwise against
# the default and an XLA reference, timed; (3) the 7B step with them, the step's optimized
# HLO kept (only the GEMM and add lines) to see why the add is not folded there.
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
timeout 100 python3 benchmarks/history/session25/add_fusion.py 2>&1 | $F | tee $OUT/add_fusion.txt | tail -8
timeout 260 python3 benchmarks/history/session23/wg_persistent.py 7b,30b --output-chunks 2>&1 \
  | $F | tee $OUT/wg_persistent.txt | tail -14
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_module_re=jit_step --xla_dump_hlo_as_text" \
  timeout 210 python3 benchmarks/step.py --out $OUT/step --shapes 7b \
  --variants topk/cp_async,topk/cp_async/persistent-wg4,topk/cp_async 2>&1 | $F | grep "^|\|kernels" | tail -8
f=$(ls /tmp/hlo/*jit_step*after_optimizations.txt 2>/dev/null | head -1)
echo "hlo: $f"; ls /tmp/hlo | head -5 > $OUT/hlo_files.txt
[ -n "$f" ] && grep -E "__cublas|wrapped_add|add_any| add\(|ROOT" "$f" | cut -c1-600 > $OUT/step_hlo_gemm_add.txt
wc -l $OUT/step_hlo_gemm_add.txt; grep -c . $f
