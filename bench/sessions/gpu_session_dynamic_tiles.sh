#!/usr/bin/env bash
# Next call for the persistent forward: causal grids with tiles claimed from a global counter (dynamic_tiles), their
# bits against one CTA per tile, and their speed beside the one-CTA-per-tile kernel, the static walk and baselines.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_dynamic_tiles.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=8 stage persistent_bits 200 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/kernels/test_cute_fwd_gpu.py -k "persistent and (dynamic or exact)"
TAIL_LINES=40 stage fwd_bench 260 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal true --directions fwd --backends cute sdpa_cudnn flash_attn_4 \
  --cute-variants fwd:persistent_ctas=132,dynamic_tiles=1 fwd:persistent_ctas=132 --rounds 3 --out-dir "$OUT"
