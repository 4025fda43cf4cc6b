#!/usr/bin/env bash
# The deterministic work-list backward (each launch's query tiles take their item's key tiles in ticket order):
# the backward work-list GPU tests (both modes), then bench/worklist.py for the deterministic backward.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_worklist3.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=8 stage wl_bwd_tests 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
  tests/kernels/test_worklist_gpu.py -k backward
TAIL_LINES=12 stage wl_bench_det 150 python3 bench/worklist.py --tokens 32768 131072 --cp 4 8 --docs 0 2048 \
  --directions bwd-det --rounds 1 --reps 5
