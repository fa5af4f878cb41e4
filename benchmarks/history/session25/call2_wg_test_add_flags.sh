# Session 25, call 2 (H200): (1) the GPU test of the persistent weight gradients, now with
# the H200's new default (4 stages, output_chunks=1) against one CTA per item, at the 7B,
# 30B, Qwen3 and d = 2880 widths; (2) why XLA leaves the router's dx add unfolded: call 1
# found beta = 1 only when the addend is a parameter. Same probe with Triton GEMM fusion
# off (the autotuner's cuBLAS fallback would not see the add), and the pass dump of the
# default run, to find the pass that decides.
export PYTHONPATH=. PYTHONUNBUFFERED=1
F="grep -v ^WARNING\|^I0000\|^W0000"
timeout 330 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py \
  -k test_weight_grad_persistent_equals_one_cta_per_item 2>&1 | tail -4
XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" timeout 80 python3 \
  benchmarks/history/session25/add_fusion.py 2>&1 | $F | tee $OUT/add_fusion_no_triton_gemm.txt | tail -7
XLA_FLAGS="--xla_dump_to=/tmp/d --xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=jit__lambda" \
  timeout 80 python3 benchmarks/history/session25/add_fusion.py > /dev/null 2>&1
ls /tmp/d | wc -l
# For each pass dump of the first module: does it hold the add and the GEMM's beta?
m=$(ls /tmp/d | grep -o "^module_[0-9]*" | sort -u | head -1)
for f in $(ls /tmp/d/${m}*.txt | sort); do
  b=$(grep -o '"beta":[0-9.]*' $f | tr '\n' ' '); a=$(grep -c " add(" $f); c=$(grep -c "custom_call_target=\"__cublas\|kind=kCustom" $f)
  echo "$(basename $f | cut -c1-90) add=$a gemm=$c $b"
done > $OUT/pass_trace.txt
grep -n "beta\|gemm" $OUT/pass_trace.txt | head -40
