#!/usr/bin/env bash
# Fourteenth session, first call: (1) the backward's early lse2 / dPsum reads (BwdConfig.early_vectors, prepared
# in the thirteenth session) beside the default at hdim 128, deterministic too, flash-attn-4 beside (prediction
# +1-3% at 1k, ~0 at 16k); (2) hdim-64 forward variants at 4k / 16k, where we trail flash-attn-4 most (0.93-0.97):
# one CTA per tile (flash-attn-4's grid), three K/V stages, the rescale threshold flipped, no scheduling barrier
# (cute_session_dev.D64_FWD_VARIANTS). One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_14.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s14 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session14
TAIL_LINES=26 stage bwd 260 python3 bench/kernels.py --headdims 128 --seqlens 1024 4096 16384 --causal false true \
  --directions bwd --deterministic --backends cute flash_attn_4 --cute-variants bwd:early_vectors=true \
  bwd-det:early_vectors=true --rounds 3 --out-dir "$OUT"
mv "$OUT/$(date +%F)-kernels.json" "$OUT/bwd-early-vectors.json" 2>/dev/null
TAIL_LINES=20 stage fwd_d64 160 python3 bench/kernels.py --headdims 64 --seqlens 4096 16384 --causal false true \
  --directions fwd --backends cute sdpa_cudnn flash_attn_4 --cute-variants fwd:persistent_ctas=0 fwd:num_stages=3 \
  fwd:rescale_threshold=8.0 fwd:rescale_threshold=0.0 fwd:sched_barrier=false --rounds 3 --out-dir "$OUT"
mv "$OUT/$(date +%F)-kernels.json" "$OUT/fwd-d64-variants.json" 2>/dev/null
cp "$OUT/compiled.txt" "$OUT/compiled-list.txt" 2>/dev/null
rm -f "$OUT"/*.png
