#!/usr/bin/env bash
# One call on one H200 for the backward's masked-last step order (non-deterministic causal: plain query tiles
# first, the sanitized causal band after them): the backward and non-finite GPU suites, the windowed cute tests,
# then bench/kernels.py with the old order as a cute variant beside the new one and flash-attn-4.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_masked_last.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=5 stage bwd_tests 170 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py
TAIL_LINES=4 stage nonfinite 70 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_cute_nonfinite_gpu.py
TAIL_LINES=4 stage window_tests 90 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_window_gpu.py \
  -k "cute and not softcap and not sinks"
TAIL_LINES=30 stage kernels_bench 170 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal true --directions bwd --backends cute flash_attn_4 --cute-variants bwd:masked_last=false --rounds 3 \
  --warmup-ms 10 --rep-ms 30 --out-dir "$OUT"
