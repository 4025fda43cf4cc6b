#!/usr/bin/env bash
# The persistent backward grid as the default for short non-deterministic fresh-gradient calls
# (backward.default_persistent_ctas, twelfth session): the backward suite under the default (its short cases now
# run on the grid; the bits test compares the grid with one CTA per tile), then the default against one CTA per
# tile and flash-attn-4 at 1k / 2k / 4k. One device call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent_bwd_default.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/persistent_bwd FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set persistent_bwd
TAIL_LINES=8 stage bwd_suite 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k "not rotated and not longest_first"
TAIL_LINES=20 stage table 150 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 4096 --causal false true \
  --directions bwd --backends cute flash_attn_4 --cute-variants bwd:persistent_ctas=0 --rounds 3 --out-dir "$OUT"
