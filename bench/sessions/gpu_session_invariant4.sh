#!/usr/bin/env bash
# Fourth call: cp_invariant's forward without the K/V expansion (GQA rows equal expanded rows, checked), the staged
# byte-equality tests again, and bench/invariant.py at hdim 128 / 64, 32k tokens.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_invariant4.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage gqa_rows 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py \
  -k gqa_rows
TAIL_LINES=6 stage invariant_cp 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py \
  -k invariant
TAIL_LINES=12 stage invariant_d128 120 python3 bench/invariant.py --tokens 32768 --heads 32:8 --reps 5 \
  --out-dir "$OUT/d128"
TAIL_LINES=12 stage invariant_d64 120 python3 bench/invariant.py --tokens 32768 --heads 32:8 --headdim 64 --reps 5 \
  --out-dir "$OUT/d64"
