#!/usr/bin/env bash
# Thirteenth session, second call for the dK / dV TMA stores: the backward suite's last 8 tests (the first call's
# 200 s stage stopped after 58 passed; these run variants whose PTX is byte-identical to before), and 16k, where
# the epilogue is a small share of a tile. One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_tma_dkv2.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=3 stage bwd_suite_rest 110 python3 -m pytest -q -p no:logging tests/kernels/test_cute_bwd_gpu.py \
  -k "128-packed or fixed_point"
TAIL_LINES=8 stage bench16k 150 python3 bench/kernels.py --headdims 128 64 --seqlens 16384 --causal false true \
  --directions bwd --backends cute flash_attn_4 --cute-variants bwd:tma_store_dkv=false --rounds 3 --out-dir "$OUT"
rm -f "$OUT"/*.png
