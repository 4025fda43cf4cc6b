#!/usr/bin/env bash
# Two open questions of the forward: hdim 64 causal at 1k-2k (0.80x cuDNN) with 128-row tiles on the persistent
# grid, and whether the ring's merges gain from the dynamic persistent grid (cp = 4 / 8 simulation, forward).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_short_causal.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=12 stage d64_tiles 150 python3 bench/kernels.py --headdims 64 --seqlens 1024 2048 --causal true \
  --directions fwd --backends cute sdpa_cudnn --cute-variants fwd:tile_m=128 fwd:tile_m=128,num_stages=3 \
  fwd:tile_n=64,num_stages=3 --rounds 3 --out-dir "$OUT"
TAIL_LINES=6 stage cp_sim_merges 100 python3 bench/cp_sim.py --seqlens 131072 --cp 4 8 --balancers lpt \
  --directions fwd --reps 3
FA4DIST_FWD_OVERRIDE=persistent_ctas=132,dynamic_tiles=1,exact_merge=1 TAIL_LINES=6 stage cp_sim_merges_dynamic 100 \
  python3 bench/cp_sim.py --seqlens 131072 --cp 4 8 --balancers lpt --directions fwd --reps 3
