#!/usr/bin/env bash
# The merge through smem and TMA (FwdConfig.tma_merge, eleventh session, compiled only): its bits against the
# direct merge, the accumulate suite with every dense merge on it, then its cost against a plain forward beside the
# direct merge's (the #11 target: within 2%; the direct merge costs +13% at 4k causal). One device call:
#   source .devwheels/install.sh && bash bench/gpu_session_tma_merge.sh
set -u
source "$(dirname "$0")/stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/tma_merge FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 120 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set tma_merge
TAIL_LINES=6 stage bits 90 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py \
  -k "tma_merge"
FA4DIST_FWD_OVERRIDE=tma_merge=1 TAIL_LINES=6 stage acc_suite 120 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/kernels/test_cute_fwd_gpu.py -k "accumulate"
TAIL_LINES=12 stage merge_cost 150 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 --causal false true \
  --directions fwd --backends cute --accumulate --accumulate-seqlens 4096 16384 \
  --accumulate-variants tma_merge=true exact_merge=true tma_merge=true,exact_merge=true --rounds 3 --out-dir "$OUT"
