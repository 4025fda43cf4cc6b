#!/usr/bin/env bash
# One call on one H200 for the ring backward's shared query side (kernels/worklist.share_queries: one preprocess
# and one dQ convert per member instead of one per step): the kernel-level test, the CP tests on one GPU (ranks
# staged through gloo), and bench/cp_sim.py with and without it (dense and a 4k window).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_shared.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage shared_tests 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k "shared or deterministic_bitwise"
TAIL_LINES=8 stage cp_gpu_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py \
  -k "bf16 or window"
TAIL_LINES=12 stage cp_sim_dense 120 python3 bench/cp_sim.py --seqlens 131072 --cp 2 8 --balancers lpt \
  --directions bwd bwd_per_call
mkdir -p "$OUT/window"
TAIL_LINES=8 stage cp_sim_window 90 env OUT="$OUT/window" python3 bench/cp_sim.py --seqlens 131072 --cp 2 8 \
  --balancers contiguous lpt --window 4095 --directions bwd bwd_per_call
