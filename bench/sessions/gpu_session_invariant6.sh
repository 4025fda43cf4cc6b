#!/usr/bin/env bash
# Sixth call: the deterministic GQA backward on the int64 dQ (backward.fixed_point_deterministic): its GPU tests
# and the deterministic subset of the backward suite, then bench/invariant.py's kernel rows (tickets, int64, and
# what deterministic=True now picks) at hdim 128 and 64.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_invariant6.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage det_tests 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k "determin or fixed_point"
TAIL_LINES=14 stage det_d128 120 python3 bench/invariant.py --tokens 32768 --heads 32:8 --reps 5 \
  --out-dir "$OUT/d128"
# hdim 64 as well when there is device time:
# TAIL_LINES=14 stage det_d64 120 python3 bench/invariant.py --tokens 16384 32768 --heads 32:8 --headdim 64 \
#   --reps 5 --out-dir "$OUT/d64"
