# Planned for the next H200 session (session 30 left 323 s of device time, too few to start).
export PYTHONPATH=. PYTHONUNBUFFERED=1
# 1. Issue 16 / 9: why the step reverses the up-proj kernels' order at 7b-n512 (inside the
#    step split-M 0.59 ms vs ping-pong 0.54; alone 0.52 vs 0.59). Each kernel alone, right
#    after the router GEMM (X just read, as in the step), and after a 256-MB pass (X out of
#    L2). If "warm" reproduces the step's order, the L2 state decides: then try (a) ordering
#    the step so the gathering kernels follow a pass over their gathered operand, (b) the
#    split-M kernel's walk (rows of a 128-row item are gathered once per column block).
timeout 300 python3 benchmarks/history/session30/up_context.py 7b,7b-n512,7b-n1024 2>&1 \
  | tee $OUT/up_context.log | grep "^|"
# 2. (Not needed: in the step at the wide shapes (calls 4 and 6) dH takes 0.46-0.48 ms, dW1
#    0.59-0.61, dX~ 0.45-0.51, no worse than at 7B (0.48, 0.63, 0.53 in session 28's step):
#    only the up-proj lost there. `backward.py --shapes 7b-n512,7b-n1024` runs them alone.)
# 3. history/session29/next_call_h200.sh item 4 (decode regions) ran in session 30 call 2;
#    the decode ideas not built are in benchmarks/NOTES.md (session 29).
