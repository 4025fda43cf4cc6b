#!/usr/bin/env bash
# hdim 64 causal short sequences on 128-row tiles (forward.short_queries) as the default: the forward and
# non-finite suites, then the default against 192-row tiles, cuDNN and flash-attn-4.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_short_causal2.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=4 stage fwd_suite 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py \
  -k "not persistent_grid"
TAIL_LINES=4 stage nonfinite_fwd 60 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/kernels/test_cute_nonfinite_gpu.py -k "forward_dense or fp16_dense or lse_is_nan or see_no_key"
TAIL_LINES=8 stage d64_short 120 python3 bench/kernels.py --headdims 64 --seqlens 512 1024 2048 --causal true \
  --directions fwd --backends cute sdpa_cudnn flash_attn_4 --cute-variants fwd:tile_m=192 --rounds 3 --out-dir "$OUT"
