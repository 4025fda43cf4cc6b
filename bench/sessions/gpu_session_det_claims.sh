#!/usr/bin/env bash
# The deterministic backward on the persistent grid with every tile claimed (TileClaims claim_first, twelfth
# session), and the default that follows from it (backward.default_persistent_ctas takes deterministic calls): the
# backward suite under the default (its bits test compares the grid with one CTA per tile, deterministic dQ
# included), then packed documents deterministic against one CTA per tile and flash-attn-4. One device call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_det_claims.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/persistent_bwd FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set persistent_bwd
TAIL_LINES=8 stage bwd_suite 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py
for d in 64 128; do
  TAIL_LINES=6 stage "packed_bwd_det_d${d}" 60 python3 bench/packed_tiles.py --direction bwd --deterministic \
    --headdim "$d" --doclen 512 1024 2048 --variants persistent_ctas=0 --rounds 3
done
