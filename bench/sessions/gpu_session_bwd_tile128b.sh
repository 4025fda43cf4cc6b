#!/usr/bin/env bash
# One H200, the rest of bench/sessions/gpu_session_bwd_tile128.sh (whose work-list and window stages ran out of time): the
# work-list backward tests (random lists; ring lists at hdim 64 and 128 through the shared query side), the
# soft-capping / sinks window tests, and the capped hdim-64 backward on 128-row tiles (which spill a few bytes in
# their masked steps) against 64-row tiles and flash-attn-4.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_bwd_tile128b.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=4 stage worklist_bwd_tests 280 python3 -m pytest -x -q -p no:cacheprovider -rfE \
  tests/kernels/test_worklist_gpu.py -k backward
TAIL_LINES=4 stage window_cap_tests 120 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py \
  -k "softcap or sinks"
TAIL_LINES=30 stage softcap_bench 150 python3 bench/kernels.py --headdims 64 --seqlens 4096 16384 --causal false true \
  --directions bwd --softcap 30 --backends cute flash_attn_4 --cute-variants d64:bwd:tile_m=128 d64:bwd:tile_m=64 \
  --rounds 3 --warmup-ms 10 --rep-ms 30 --out-dir "$OUT"
