#!/usr/bin/env bash
# One H200: ring steps with their fully visible blocks joined (worklist.coalesce, in Schedule.items): the ring
# simulation at 128k, the ring / Ulysses / hybrid GPU tests with staged ranks, the ring work-list tests.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_coalesce.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=12 stage cp_sim 80 python3 bench/cp_sim.py --seqlens 131072 --cp 8 4 --balancers lpt --reps 2
TAIL_LINES=4 stage worklist_ring 150 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py \
  -k ring_schedule
TAIL_LINES=4 stage cp_tests 170 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py -k "not invariant"
