#!/usr/bin/env bash
# One call on one H200 for the forward's exp2 on the FMA pipe (softmax.py, common_sm90.exp2_poly): the variants
# compiled ahead of time (carried in .aot when built on the CPU from the same sources, else built here in
# parallel), the polynomial's GPU test, bench/kernels.py sweeping exp2_poly_every beside flash-attn-4 (soft-capped
# and plain scores), the non-finite forward cases with every exp2 emulated, the shared-query-side backward
# tests, and the host-time profile of a short call.
#   source .devwheels/install.sh && bash bench/gpu_session_exp2.sh
set -u
source "$(dirname "$0")/stage.sh"
export FA4DIST_CUTE_AOT_DIR=${FA4DIST_CUTE_AOT_DIR:-$PWD/.aot}
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 14 --set exp2
TAIL_LINES=6 stage exp2_test 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py \
  -k exp2
VARIANTS="fwd:exp2_poly_every=0 fwd:exp2_poly_every=2 fwd:exp2_poly_every=3 fwd:exp2_poly_every=4 fwd:exp2_poly_every=8"
TAIL_LINES=16 stage softcap_bench 120 python3 bench/kernels.py --headdims 128 --seqlens 4096 16384 --directions fwd \
  --softcap 30 --backends cute flash_attn_4 --cute-variants $VARIANTS --rounds 3 --out-dir "$OUT/softcap"
TAIL_LINES=30 stage exp2_bench 170 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 --directions fwd \
  --backends cute flash_attn_4 --cute-variants $VARIANTS --rounds 3 --out-dir "$OUT/plain"
FA4DIST_FWD_OVERRIDE="exp2_poly_every=1" TAIL_LINES=6 stage nonfinite_exp2 90 python3 -m pytest -q \
  -p no:cacheprovider -rfE tests/kernels/test_cute_nonfinite_gpu.py -k "forward or lse or rows_that or fp16"
TAIL_LINES=4 stage shared_bwd 80 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k shared
TAIL_LINES=70 stage host_profile 60 python3 bench/host_profile.py --calls 30 --top 15
