#!/usr/bin/env bash
# Second call: cp_invariant's cost on one GPU at hdim 128 and 64, 16k and 32k tokens (bench/invariant.py), with the
# CuTe backward's fp32 / ticketed / int64 dQ for GQA and for K/V expanded per query head.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_invariant2.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=30 stage invariant_d128 200 python3 bench/invariant.py --tokens 16384 32768 --heads 32:8 --reps 5 \
  --out-dir "$OUT/d128"
TAIL_LINES=30 stage invariant_d64 200 python3 bench/invariant.py --tokens 16384 32768 --heads 32:8 --headdim 64 \
  --reps 5 --out-dir "$OUT/d64"
