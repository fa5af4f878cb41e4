# Session 30, call 7 (issue 17): nvidia-h200-x2 was lent for the first time, with ~290 s of
# device time left. The part never run on hardware: EP = 2 with the ragged_all_to_all
# dispatch on the kernel path, against one device (outputs and every gradient), top-K and
# token rounding, random and skewed routing; then the xla path under check_vma=True.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 200 python3 benchmarks/ep.py --backend mosaic --ep 2 --dispatch ragged_all_to_all \
  --overlap none --skip-bench --out $OUT/ep2.md 2>&1 | grep -v "cuda_event\|^W0000\|^I0000" \
  | tee $OUT/ep2.log | grep -- "^- \|Error\|error" | tail -20
