#!/usr/bin/env bash
# The kernels' table with every default of the eleventh session (the rotated deterministic order, hdim 96's causal
# persistent forward), beside torch's cuDNN op and flash-attn-4 in one process, and the backward on a 132-CTA
# persistent grid as a second sample for its default. One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_table11.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/table11 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot_bwd 110 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set persistent_bwd
TAIL_LINES=2 stage aot_all 60 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set all
TAIL_LINES=40 stage table 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal false true --directions fwd bwd --deterministic --backends cute sdpa_cudnn flash_attn_4 \
  --cute-variants bwd:persistent_ctas=132 --rounds 3 --warmup-ms 10 --rep-ms 40 --out-dir "$OUT"
