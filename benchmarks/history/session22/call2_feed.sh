# Session 22, call 2 (issue 16): call 1 found the ping-pong up-proj's feed alone (no wgmma) at
# 537 of its 583 us without epilogue, and 16 weight TMAs per step (fused) costing ~33 cycles
# each. Which part of the producer's step: its cp.async latency (publish lag stages - 2),
# stage count, weight bytes, L2 prefetch? Then the per-step producer regions, profiled.
set -x
export PYTHONPATH=. PYTHONUNBUFFERED=1
P=up_pingpong+noepilogue+nomma
timeout 300 python3 benchmarks/timeline.py --plain --out $OUT --shapes 7b --kernels $P,$P+gather_completion=mbarrier,$P+num_stages=4,$P+prefetch_steps=8,$P+halfweights,up_coop+noepilogue+nomma,up_coop+noepilogue+nomma+gather_completion=mbarrier,up_pingpong,up_pingpong+gather_completion=mbarrier,up_pingpong+prefetch_steps=8,$P 2>&1 | grep -v "^WARNING\|^I0000\|^W0000\|^  CUPTI\|^==" | tail -14
mkdir -p $OUT/prof
timeout 150 python3 benchmarks/timeline.py --out $OUT/prof --regions 160 --shapes 7b --kernels $P,up_pingpong 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -60
timeout 100 python3 -m pytest -p no:xdist -q -m gpu tests/test_gpu.py -k "test_up_proj_pingpong_equals_cooperative and (shape3 or shape4)" 2>&1 | tail -4
