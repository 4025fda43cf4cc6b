#!/usr/bin/env bash
# Second call: the ring simulation's backward at cp 8 with and without the joined blocks, interleaved runs (the
# baseline is the previous commit's fa4dist with this cp_sim.py: .kwt/inv/{fa4dist,bench/cp_sim.py}), and the ring
# work-list tests.
set -u
source "$(dirname "$0")/../stage.sh"
for i in 1; do
  TAIL_LINES=3 stage sim_joined_$i 55 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt --reps 3 \
    --directions bwd
  TAIL_LINES=3 stage sim_base_$i 55 python3 .kwt/inv/bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --reps 3 --directions bwd
done
TAIL_LINES=4 stage worklist_ring 80 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py \
  -k "ring_schedule and not 64-2"
