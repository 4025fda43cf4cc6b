#!/usr/bin/env bash
# Third call: the GPU suites the one-pass cp_invariant change touches (the CuTe backward, the backends through the
# contract, context parallelism with staged ranks), to check nothing else moved.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_invariant3.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage bwd_gpu 300 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/kernels/test_cute_bwd_gpu.py
TAIL_LINES=6 stage cp_gpu 250 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/cp/test_cp_gpu.py
