PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 250 python3 benchmarks/history/session28/epilogue_wg_regs.py 2>&1 | grep "^|\|rror"
