#!/usr/bin/env bash
# Second call for the dynamic walk: work-list launches (packed) on it, as the ring's steps would run them. The
# work-list forward tests with every forward launch on the dynamic persistent grid (the per-item loop's calls too),
# then the cp = 8 ring simulation's forward without and with it.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_dynamic_tiles2.sh
set -u
source "$(dirname "$0")/../stage.sh"
FA4DIST_FWD_OVERRIDE=persistent_ctas=132,dynamic_tiles=1 TAIL_LINES=4 stage worklist_fwd_dynamic 200 \
  python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py \
  -k "random_lists_equal_the_loop and not backward or ring_schedule_lists"
TAIL_LINES=8 stage cp_sim_fwd 120 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
  --directions fwd --reps 2
FA4DIST_FWD_OVERRIDE=persistent_ctas=132,dynamic_tiles=1 TAIL_LINES=8 stage cp_sim_fwd_dynamic 120 \
  python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt --directions fwd --reps 2
