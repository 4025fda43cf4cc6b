#!/usr/bin/env bash
# Prepared in the thirteenth session, not yet run: BwdConfig.early_vectors (hdim 128's 64-row query tiles), each
# step's lse2 / dPsum columns read from smem while the step's S^T / dP^T GEMMs run instead of at their use. The
# SASS-level samples (gpu_session_ncu_source.sh) had 2.9% of the short causal backward's warp samples on the
# FFMA that subtracts lse2 right after its shared load (flash-attn-4: 0.5%). Prediction: +1-3% at 1k, ~0 at 16k.
# Part 1: the backward suite under the knob (hdim 64 ignores it); part 2: the bench. Two calls:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_early_vectors.sh 1|2
set -u
source "$(dirname "$0")/../stage.sh"
if [ "${1:-1}" = 1 ]; then
  export FA4DIST_BWD_OVERRIDE=early_vectors=1
  TAIL_LINES=4 stage bwd_suite 500 python3 -m pytest -q -x -p no:logging tests/kernels/test_cute_bwd_gpu.py
  exit
fi
TAIL_LINES=16 stage bench 500 python3 bench/kernels.py --headdims 128 --seqlens 1024 4096 16384 --causal false true \
  --directions bwd --deterministic --backends cute flash_attn_4 --cute-variants bwd:early_vectors=true \
  bwd-det:early_vectors=true --rounds 3 --out-dir "$OUT"
rm -f "$OUT"/*.png
