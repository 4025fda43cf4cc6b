#!/usr/bin/env bash
# One call on one H200 for the one-pass cp_invariant backward (int64 fixed-point dQ): the kernel's GPU tests
# (fixed-point dQ against the fp32 one, split launches, dk/dv bytes; the one-gradient variants), the cp_invariant
# byte-equality tests with staged ranks, then bench/invariant.py (cp_invariant's cost on one GPU, and the CuTe
# backward with fp32 / ticketed / int64 dQ).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_invariant.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage fixed_test 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k "fixed_point or one_gradient"
TAIL_LINES=6 stage invariant_cp 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py \
  -k invariant
TAIL_LINES=40 stage invariant_bench 180 python3 bench/invariant.py --tokens 32768 --heads 32:8 --reps 5 --profile \
  --out-dir "$OUT"
