#!/usr/bin/env bash
# What a default for the persistent backward grid (BwdConfig.persistent_ctas) still needs after the eleventh
# session's two samples (bench/RESULTS.md): the backward suite forced onto a 132-CTA grid to its end (the last call
# ran 40 of its tests before the stage's limit), and packed causal documents (short ones: where dense 1k gained
# 6-10%) on the grid against one CTA per tile and flash-attn-4, deterministic too. Two device calls:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent_bwd2.sh 1   # the forced suite
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent_bwd2.sh 2   # packed documents
# (A two-GPU check that the ring's NCCL transfers keep their overlap beside the grid comes after, on
# nvidia-h200-x2: bench/multigpu.py with FA4DIST_BWD_OVERRIDE=persistent_ctas=132.)
set -u
part=${1:-1}
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/persistent_bwd FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set persistent_bwd
if [ "$part" = 1 ]; then
FA4DIST_BWD_OVERRIDE=persistent_ctas=132 TAIL_LINES=8 stage bwd_suite_persistent 400 python3 -m pytest -q \
  -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py -k "not persistent_grid and not rotated and not longest_first"
fi
if [ "$part" = 2 ]; then
for d in 64 128; do
  for det in "" --deterministic; do
    TAIL_LINES=6 stage "packed_bwd_d${d}${det:+_det}" 100 python3 bench/packed_tiles.py --direction bwd $det \
      --headdim "$d" --doclen 512 1024 2048 --variants persistent_ctas=132 --rounds 3
  done
done
fi
