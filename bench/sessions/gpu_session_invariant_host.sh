#!/usr/bin/env bash
# One H200: cp_invariant's host-side passes trimmed (K/V maxima before the expansion, the dq conversion in one
# pass), timed against the previous commit (carried in .kwt/inv: git archive HEAD~ fa4dist | tar -x -C .kwt/inv);
# the ring simulation at 128k with the merge-epilogue change; the staged-rank byte-equality tests; the rest of the
# window suite.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_invariant_host.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=4 stage cp_invariant_tests 100 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py \
  -k invariant
TAIL_LINES=30 stage invariant_bench 130 python3 bench/invariant.py --tokens 32768 --heads 32:8 --reps 5 \
  --baseline-dir .kwt/inv --profile --out-dir "$OUT"
TAIL_LINES=12 stage cp_sim 150 python3 bench/cp_sim.py --seqlens 131072 --cp 8 4 --balancers lpt --reps 2
TAIL_LINES=4 stage window_tests 160 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py \
  -k "(reproducible and 128) or split_keys or garbage or between or softcap or sinks"
