#!/usr/bin/env bash
# The causal forward's head grouping, second look (thirteenth session). The first look
# (gpu_session_l2_rows.sh, one run) had hdim 128 causal 16k at 623-626 TFLOP/s with one head per group against
# 602 with the default three (flash-attn-4 629), and 4k best with the default twelve. Here every length gets
# groups of 1, 2, 4 and 8 heads (l2_rows = S * heads; the default is 24 MB of K + V rows) in five interleaved
# rounds, so that a rule can be read off:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_l2_rows2.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
for S in 4096 8192 16384 32768; do
  TAIL_LINES=4 stage "d128_$S" 150 python3 bench/kernels.py --headdims 128 --seqlens $S --causal true \
    --directions fwd --backends cute flash_attn_4 --cute-variants fwd:l2_rows=$S fwd:l2_rows=$((2 * S)) \
    fwd:l2_rows=$((4 * S)) fwd:l2_rows=$((8 * S)) --rounds 5 --out-dir "$OUT/d128_$S"
done
for S in 4096 16384; do
  TAIL_LINES=4 stage "d64_$S" 120 python3 bench/kernels.py --headdims 64 --seqlens $S --causal true \
    --directions fwd --backends cute flash_attn_4 --cute-variants fwd:l2_rows=$S fwd:l2_rows=$((4 * S)) \
    fwd:l2_rows=$((16 * S)) --rounds 5 --out-dir "$OUT/d64_$S"
done
