# Session 36, call 1 (nvidia-h200-x2): issue 17's overlap target on the all-gather dispatch.
# Session 35's prepared part G at EP = 2 (x4 was not lent): overlap none against chunked
# with comm_sms 0 / 16 / 32 (traced), plus the chunked mode's correctness checks.
EPS=2 bash benchmarks/history/session35/next_calls.sh G
