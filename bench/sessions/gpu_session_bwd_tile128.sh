#!/usr/bin/env bash
# One H200, two calls, for the hdim-64 backward on 128-row query tiles (backward.tile_m_for) and the MMA loop
# walked phase by phase (bwd_sm90.FlashBwdSm90.phases):
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_bwd_tile128.sh 1   # suites the change touches, bench
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_bwd_tile128.sh 2   # work lists, windows, ring
# The bench times both tiles through the kernels' entry point (cute variants bwd:tile_m=128 / 64, deterministic
# too) beside the contract's default and flash-attn-4.
set -u
source "$(dirname "$0")/../stage.sh"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=5 stage bwd_tests 200 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py
  TAIL_LINES=4 stage nonfinite 80 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_nonfinite_gpu.py
  TAIL_LINES=60 stage kernels_bench 290 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 16384 \
    --causal false true --directions bwd --deterministic --backends cute flash_attn_4 \
    --cute-variants d64:bwd:tile_m=128 d64:bwd:tile_m=64 --rounds 3 --warmup-ms 10 --rep-ms 30 --out-dir "$OUT"
else
  TAIL_LINES=4 stage worklist_tests 150 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py
  TAIL_LINES=4 stage window_tests 150 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py \
    -k "cute or between"
  TAIL_LINES=4 stage cp_tests 150 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py
fi
