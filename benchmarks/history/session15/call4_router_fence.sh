set -x
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 280 python3 benchmarks/history/session15/router_ab.py 7b,30b 2>&1 | grep -v "^I0000\|^W0000" | tee $OUT/router_ab.txt
timeout 270 python3 benchmarks/history/session15/regs.py $OUT coop,coop_mfence,coop_ep32_mfence,pp_ep16_mfence,pp_mfence 2>&1 | grep -v "^I0000\|^W0000" | tee $OUT/regs.txt
