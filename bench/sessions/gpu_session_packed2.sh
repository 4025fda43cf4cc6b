#!/usr/bin/env bash
# Packed 16-bit forward launches on the dynamic persistent grid by default (ninth session, after the device time
# was spent): the packed forward tests, the work-list forward tests, then the ring simulation's forward.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_packed2.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=4 stage packed_fwd 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py \
  tests/kernels/test_cute_nonfinite_gpu.py tests/kernels/test_window_gpu.py \
  -k "test_varlen or gqa_rows_equal and packed or forward_packed or cute_windowed_packed or packed_windows and cute"
TAIL_LINES=4 stage worklist_fwd 200 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py \
  -k "random_lists_equal_the_loop and not backward or ring_schedule_lists"
TAIL_LINES=8 stage cp_sim_fwd 100 python3 bench/cp_sim.py --seqlens 131072 --cp 4 8 --balancers lpt --directions fwd \
  --reps 3
