#!/usr/bin/env bash
# hdim 64 forward: 192-row tiles (the default) against 128-row ones at lengths where 192 rows pad the last tile
# (512: 12.5%, 1024: 12.5%, 1280: 5%, 2048: 3%, 2560: 5%), causal and not, beside cuDNN.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_d64_tile_m.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=14 stage d64_tile_m 200 python3 bench/kernels.py --headdims 64 --seqlens 512 1024 1280 2048 2560 \
  --causal true false --directions fwd --backends cute sdpa_cudnn --cute-variants fwd:tile_m=128 --rounds 3 \
  --out-dir "$OUT"
