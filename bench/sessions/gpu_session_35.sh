#!/usr/bin/env bash
# Prepared in the thirty-fourth session (2026-12-04), results in bench/results/2026-12-04-thirty-fourth-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_35.sh 1    (flash-attn-4 carried: --with-fa4)
# Stage 1 ran on commit b951661 (the deterministic split and split_tail.py --deterministic), reverted after it: the
# split measured 9-29% slower (bench/RESULTS.md, thirty-fourth session).
# 1: the deterministic causal backward of few waves splits its longest key tiles too (split_keys_variant, no
#    longer non-deterministic only). Its shortest-first claims stay (a dQ ticket waits only on higher key tiles,
#    claimed before it: no deadlock), so the longest key tiles' parts are claimed last (tile_scheduler.parts_last),
#    and every (key tile, query tile) pair is one part's: the dQ tickets add in the unsplit order (the same dQ
#    bits). (a) the split tests, deterministic now too (oracle, run-to-run bytes of all three gradients, dQ the
#    unsplit launch's bytes, dK / dV outside the split tiles the unsplit bytes, NaN patterns), and the
#    deterministic suites; (b) bench/split_tail.py --deterministic in device time beside flash-attn-4's
#    deterministic backward. Prediction: below the non-deterministic split's gains (+28 / +72 / +53 / +49 / +14%
#    at hdim 128 4 x 4k / 1 x 16k / 2 x 8k / 3 x 4k / 8 x 2k), since the longest tiles' parts start last and a
#    part of late query tiles waits on the unsplit key tiles' tickets: +10-40%; nothing at 8 x 4k (no split).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s35 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=8 stage tests_det_split 240 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py \
    -k "split or determin or persistent"
  TAIL_LINES=12 stage det_split_128 150 python3 bench/split_tail.py --direction bwd --causal --deterministic \
    --headdim 128 --shapes 1x4096x4 1x16384x1 1x8192x2 1x4096x3 1x2048x8 1x4096x8 --rounds 3 \
    --out-dir "$OUT/det_split_128"
  TAIL_LINES=8 stage det_split_64 90 python3 bench/split_tail.py --direction bwd --causal --deterministic \
    --headdim 64 --shapes 1x4096x4 1x8192x2 1x4096x8 --rounds 3 --out-dir "$OUT/det_split_64"
  exit
fi
