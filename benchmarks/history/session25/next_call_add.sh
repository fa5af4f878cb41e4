# Planned for the next session (issue 9, ~60 s): can the router's dx add (the 7B step's
# 56-us `wrapped_add`) fold into its cuBLAS GEMM without a global XLA flag? Session 25 found
# XLA folds it only for a parameter addend, or with Triton GEMM fusion off. The new rows put
# the addend behind an optimization barrier (as the step's Pallas output) and try dot forms
# that might keep the dot out of the Triton GEMM fusion. A row with beta 1 and no Loop
# fusion, at about 42 us, is the form for `nn.functional._bf16_linear_bwd`.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 120 python3 benchmarks/history/session25/add_fusion.py 2>&1 | grep "^|"
