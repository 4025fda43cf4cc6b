#!/usr/bin/env bash
# One call on one H200: forward pipeline depth and tile shapes as cute variants beside the defaults, cuDNN and
# flash-attn-4 (hdim 64: 3 K/V stages, 128-row tiles, both rescale thresholds; hdim 128: 3 K/V stages). Every
# variant compiled on the CPU first without spills (tile_n 160 / 176 at hdim 128 serialize the wgmmas, tile_n
# 160 / 192 at hdim 64 spill: not run).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_fwd_tiles.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=30 stage fwd_tiles 400 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 16384 \
  --directions fwd --backends cute sdpa_cudnn flash_attn_4 --cute-variants d64:fwd:num_stages=3 \
  d64:fwd:tile_m=128 d64:fwd:rescale_threshold=8.0 d64:fwd:rescale_threshold=0.0 d128:fwd:num_stages=3 \
  --rounds 3 --out-dir "$OUT/fwd_tiles"
