#!/usr/bin/env bash
# Prepared in the thirty-second session (2026-12-04), results in bench/results/2026-12-04-thirty-second-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_33.sh 1    (flash-attn-4 carried: --with-fa4)
# 1: the sliding window at 32k (W = 4096, #15's target: forward and forward+backward >= 1.0x flash-attn-4; last
#    measured 0.94-1.05 / 0.95-0.98). A windowed tile is mostly full key blocks, as a long non-causal one, yet two
#    knobs measured faster there are off for windows by default: the chained row max in the forward (+1-2% at
#    hdim-128 non-causal 16k / 32k, eighteenth session) and the early lse2 / dPsum reads in the backward (+0-4%
#    non-causal, fourteenth session; off for causal non-deterministic, where it lost 2% at 4k). Both give the same
#    bits. Prediction: each +0-2% on its direction's window row; the causal row within noise.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s33 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
WIN="python3 bench/window.py --rounds 5 --queue-ahead-ms 5"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=14 stage window_default 150 $WIN --out-dir "$OUT/window_default"
  TAIL_LINES=14 stage window_chained 150 env FA4DIST_FWD_OVERRIDE=chained_max=1 $WIN --out-dir "$OUT/window_chained"
  TAIL_LINES=14 stage window_early 150 env FA4DIST_BWD_OVERRIDE=early_vectors=1 $WIN --out-dir "$OUT/window_early"
  exit
fi
