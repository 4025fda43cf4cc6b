#!/usr/bin/env bash
# One call on one H200 for the torch-op guard (kernels/guard.py): the GPU tests that run torch's fused ops under
# it (backends, windows), then bench/kernels.py on sdpa_cudnn / sdpa_flash causal (guarded) and full (unguarded).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_guard.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=4 stage backend_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_backends_gpu.py \
  tests/kernels/test_window_gpu.py -k "not cute"
TAIL_LINES=14 stage guard_bench 150 python3 bench/kernels.py --headdims 128 --seqlens 1024 16384 \
  --backends sdpa_cudnn sdpa_flash flash_attn_4 --rounds 3 --out-dir "$OUT/guard"
