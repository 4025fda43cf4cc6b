#!/usr/bin/env bash
# One call on one H200 for soft-capping with a fixed row max (cute/softmax.softcap_fixed_row_max): the variants
# compiled ahead of time in parallel, the softcap and sinks GPU tests, bench/window.py (the cost of softcap and
# sinks against causal, windows, all beside flash-attn-4), and bench/kernels.py with the running-max kernel as a
# variant beside the fixed one at caps 30 and 50.
#   source .devwheels/install.sh && bash bench/gpu_session_softcap.sh
set -u
source "$(dirname "$0")/stage.sh"
export FA4DIST_CUTE_AOT_DIR=${FA4DIST_CUTE_AOT_DIR:-/tmp/fa4dist-aot}
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 14 --set softcap
TAIL_LINES=8 stage softcap_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py \
  -k "cute and (softcap or sinks)"
TAIL_LINES=12 stage window_bench 110 python3 bench/window.py --out-dir "$OUT/window"
for cap in 30 50; do
  TAIL_LINES=10 stage "kernels_softcap$cap" 100 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
    --directions fwd --softcap $cap --backends cute flash_attn_4 --cute-variants fwd:softcap_fixed_max=false \
    --rounds 3 --out-dir "$OUT/softcap$cap"
done
