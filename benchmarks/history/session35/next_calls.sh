# Planned for the next session. `bash next_calls.sh PART`; each part <= 10 min, <= 8 files
# under $OUT. Parts by machine kind:
#   nvidia-h200-x4 (or -x2: EP = 2 only, set EPS=2): G (the all-gather dispatch's chunked
#                   overlap, issue 17's overlap target), then R (ragged strong EP = 4).
#   nvidia-h200-x8: X8 (the whole ep.py sequence at EP = 8: the weak-scaling target).
#   nvidia-h200: history/session33/next_call_h200.sh A (decode context, issue 15) and
#                B (up-proj ncu inside the step, issues 16/9).
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/ep
T0=$(date +%s)
N=$(nvidia-smi -L | wc -l); EPS=${EPS:-2,4}; [ "$N" -lt 4 ] && EPS=2
summary() {  # the check and bench lines of every log, short
  grep -h "^check" /tmp/ep/*.log > $OUT/checks.log 2>/dev/null
  grep "^link\|^bench\|^trace" /tmp/ep/*.log | sed "s#/tmp/ep/##; s#\.log:# #" > $OUT/bench.log
  for f in /tmp/ep/*.md; do echo "## $f"; cat $f; done > $OUT/ep_tables.md 2>/dev/null
  tar czf $OUT/logs.tar.gz /tmp/ep/*.log /tmp/ep/*.json /tmp/ep/hlo 2>/dev/null
  grep -h "^|" /tmp/ep/*.md | grep -v "^|---\|^| scaling" | cut -d'|' -f2-13
}
case "${1:-G}" in
G)
  # Session 35 (calls 1-3): the ragged dispatch's combine cannot overlap (XLA runs the
  # decomposed ragged all-to-all synchronously: the schedule report found no async
  # collective, the trace 0-11% hidden, 32 free SMs changed nothing). The all-gather
  # dispatch's collectives are async (its reduce-scatter was 50-52% hidden at EP = 2
  # strong with overlap "none", 24% at EP = 4). New: overlap="chunked" for the all-gather
  # dispatch (token chunks, each with its own all-gather / experts / reduce-scatter) and
  # comm_sms for it. Prediction: with 2 chunks chunk 0's reduce-scatter runs beside chunk
  # 1's experts; hidden share of the forward's collectives rises from 21-39% (none) to
  # >= 50%; if it stays level with comm_sms 0 and rises with 16-32, the persistent kernels'
  # SMs were what NCCL's kernels waited for. Cost: fwd+bwd within 5% of "none" at strong.
  EP="python3 benchmarks/ep.py --ep $EPS --gpu-lock /tmp/ep.lock --turn-limit 150 --backend mosaic --dispatch all_gather --dump-hlo /tmp/ep/hlo"
  job() { name=$1; frac=$2; shift 2; XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 540 $EP "$@" --out /tmp/ep/$name.md > /tmp/ep/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s) - T0 )) s"; }
  job g_none 0.2 --skip-check --overlap none --iters 5 &
  job g_c0 0.2 --skip-check --overlap chunked --iters 5 &
  job g_c16 0.2 --skip-check --overlap chunked --comm-sms 16 --iters 5 &
  job g_c32 0.2 --skip-check --overlap chunked --comm-sms 32 --iters 5 &
  job g_chk 0.05 --skip-bench --overlap chunked &
  wait; summary ;;
R)
  # The strong EP = 4 ragged row session 35 lost (the decomposer asked for a 22.3 GiB
  # buffer; one rank out of memory, the other hung): alone, with the whole GPU memory.
  timeout 400 python3 benchmarks/ep.py --ep 4 --backend mosaic --dispatch ragged_all_to_all --overlap none \
    --skip-check --scaling strong --iters 5 --dump-hlo /tmp/ep/hlo --out /tmp/ep/r.md > /tmp/ep/r.log 2>&1
  summary ;;
X8)
  EP="python3 benchmarks/ep.py --ep 2,4,8 --gpu-lock /tmp/ep.lock --turn-limit 150 --backend mosaic"
  job() { name=$1; frac=$2; shift 2; XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout 540 $EP "$@" --out /tmp/ep/$name.md > /tmp/ep/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s) - T0 )) s"; }
  job c_ag 0.04 --skip-bench --dispatch all_gather &
  job c_ra 0.04 --skip-bench --dispatch ragged_all_to_all --check-routings topk &
  job s_ag 0.2 --skip-check --scaling strong --dispatch all_gather --iters 5 &
  job w_ag 0.1 --skip-check --scaling weak --dispatch all_gather --iters 5 &
  job w_ra 0.3 --skip-check --scaling weak --dispatch ragged_all_to_all --overlap none --iters 5 &
  wait; summary ;;
esac
echo "done in $(( $(date +%s) - T0 )) s"
