#!/usr/bin/env bash
# Thirteenth session: fresh dK / dV through a staging tile and TMA stores (BwdConfig.tma_store_dkv), as
# flash-attn-4 writes them. The counters (gpu_session_ncu_source.sh) had 10.6% of our short causal backward's warp
# samples on the 1M plain global stores of the dK / dV epilogue. The backward suite under the new default, then
# the dense backward at 1k and 4k against the stores from registers and flash-attn-4. One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_tma_dkv.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/tma_dkv FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 120 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set tma_dkv
TAIL_LINES=6 stage bwd_suite 200 python3 -m pytest -q -x -p no:logging tests/kernels/test_cute_bwd_gpu.py
TAIL_LINES=24 stage bench 240 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 --causal false true \
  --directions bwd --deterministic --backends cute flash_attn_4 --cute-variants bwd:tma_store_dkv=false \
  --rounds 3 --out-dir "$OUT"
rm -f "$OUT"/*.png
