#!/usr/bin/env bash
# The work-list forward in few launches (cute backend forward_items): its GPU tests, the ring and forward suites
# that now run through it, then bench/worklist.py (one-launch vs per-item loop on real ring schedules).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_worklist.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=8 stage wl_tests 300 python3 -m pytest -q -x -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py
TAIL_LINES=6 stage cp_tests 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py
TAIL_LINES=14 stage wl_bench 200 python3 bench/worklist.py --tokens 32768 131072 --cp 4 8 --docs 0 2048
