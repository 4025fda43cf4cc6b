#!/usr/bin/env bash
# A launch's items longest first (backend._longest_first): the work-list GPU tests that cover it (forward random
# and ring lists, backward ring lists in both modes), then the packed rows of bench/worklist.py.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_worklist4.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage wl_tests 200 python3 -m pytest -q -x -p no:cacheprovider -rfE --tb=short \
  tests/kernels/test_worklist_gpu.py -k "test_random_lists_equal_the_loop or test_ring_schedule or backward_ring"
TAIL_LINES=8 stage wl_bench 80 python3 bench/worklist.py --tokens 32768 --cp 8 --docs 2048 --directions fwd bwd
