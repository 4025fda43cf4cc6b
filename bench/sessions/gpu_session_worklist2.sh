#!/usr/bin/env bash
# The work lists in few launches, forward and backward (cute forward_items / backward_items): the work-list GPU
# tests, the ring suite that runs through them, the backward suite, then bench/worklist.py both directions.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_worklist2.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=8 stage wl_tests 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/kernels/test_worklist_gpu.py
TAIL_LINES=6 stage cp_tests 240 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/cp/test_cp_gpu.py
TAIL_LINES=20 stage wl_bench 240 python3 bench/worklist.py --tokens 32768 131072 --cp 4 8 --docs 0 2048
