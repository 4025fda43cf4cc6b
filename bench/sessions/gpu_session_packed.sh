#!/usr/bin/env bash
# Packed causal documents (one varlen launch): 128-row tiles at hdim 64 and the dynamic persistent grid, against
# the default (one CTA per tile, 192 rows at hdim 64) and flash-attn-4's varlen forward.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_packed.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=12 stage packed_d64 80 python3 bench/packed_tiles.py --headdim 64 --doclen 512 1024 2048 \
  --variants tile_m=128 persistent_ctas=132 tile_m=128,persistent_ctas=132
TAIL_LINES=8 stage packed_d64_mixed 60 python3 bench/packed_tiles.py --headdim 64 --doclen 512 --mixed \
  --variants tile_m=128 tile_m=128,persistent_ctas=132
TAIL_LINES=8 stage packed_d128 60 python3 bench/packed_tiles.py --headdim 128 --doclen 1024 4096 \
  --variants persistent_ctas=132
