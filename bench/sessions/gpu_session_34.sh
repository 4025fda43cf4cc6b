#!/usr/bin/env bash
# Prepared in the thirty-third session (2026-12-04), results in bench/results/2026-12-04-thirty-third-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_34.sh 1    (flash-attn-4 carried: --with-fa4)
# 1: the causal forward of few waves (thirty-second session: 4 heads of 128, batch 1, 0.92x flash-attn-4 and half
#    of cuDNN at 4k). A launch of one wave or less ends with its longest tile, about twice the average: the split
#    now covers dense causal launches too (forward.causal_split_plan: the longest rows of tiles of every head in
#    parts claimed first, merged by the last part in part order). (a) the forward GPU tests (the causal split tiles
#    against the fp64 oracle, the unsplit launch's bytes elsewhere, run-to-run bytes, NaN rows seen / unseen; the
#    non-causal split, dense, persistent and schedule-field suites, whose causal dense launches now dispatch
#    through the split variant's plan); (b) bench/split_tail.py --causal in device time beside cuDNN and
#    flash-attn-4. Prediction (the plan's simulation): +45-90% on one-wave shapes (4 x 4k: 1.52x, 8 x 2k: 1.45x,
#    1 x 16k: 1.88x, 2 x 8k: 1.73x, 3 x 4k: 1.73x), +23% at 5 x 4k, nothing at 8 x 4k (no split: two waves).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s34 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=8 stage tests_fwd 220 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py \
    -k "split or dense or persistent or schedule"
  TAIL_LINES=12 stage causal_split_128 150 python3 bench/split_tail.py --causal --headdim 128 --shapes 1x4096x4 \
    1x2048x8 1x16384x1 1x8192x2 1x4096x3 1x4096x5 1x4096x8 --rounds 3 --out-dir "$OUT/causal_split_128"
  TAIL_LINES=8 stage causal_split_64 90 python3 bench/split_tail.py --causal --headdim 64 --shapes 1x4096x4 \
    1x8192x2 1x4096x8 --rounds 3 --out-dir "$OUT/causal_split_64"
  exit
fi
# 2: call 1: the causal split passed its tests (93 with the rest of the forward suites) and gained +18 / +1 / +62 /
#    +44 / +43 / +7% (hdim 128, 4 x 4k / 8 x 2k / 1 x 16k / 2 x 8k / 3 x 4k / 5 x 4k heads x tokens, halves) and
#    +45 / +70% at hdim 64 (4 x 4k, 2 x 8k) in device time, against +52 / +45 / +88 / +73 / +73 / +23% predicted: the
#    model left out the fixed cost of every tile and part. Refitted (SPLIT_CAUSAL_ITEM_BLOCKS 5, merge 1 per part)
#    the plans change: 4 x 4k and 3 x 4k split 9 rows in halves (was 11 / 14), 8 x 2k 3 rows (was 5), 2 x 8k 20
#    (was 57), 1 x 4k 17 tiles in quarters, 2 x 4k 16 rows in thirds. Prediction from the refitted model: +32 / +17
#    / +66 / +41 / +48 / +12%, 1 x 4k +85%, 2 x 4k +76% (hdim 128); hdim 64's 192-row tiles also split 6 x 4k and
#    4 x 8k now (the same model). The causal split tests again on the new plans.
if [ "$1" = 2 ]; then
  TAIL_LINES=4 stage tests_causal_split 150 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py -k "causal_split"
  TAIL_LINES=12 stage causal_split_128 150 python3 bench/split_tail.py --causal --headdim 128 --shapes 1x4096x4 \
    1x2048x8 1x16384x1 1x8192x2 1x4096x3 1x4096x5 1x4096x1 1x4096x2 --rounds 3 --out-dir "$OUT/causal_split_128"
  TAIL_LINES=8 stage causal_split_64 90 python3 bench/split_tail.py --causal --headdim 64 --shapes 1x4096x4 \
    1x8192x2 1x4096x6 1x8192x4 --rounds 3 --out-dir "$OUT/causal_split_64"
  exit
fi
