#!/usr/bin/env bash
# Second call: the persistent grid on dense launches only (packed ones hung: the producer's registers), default for
# non-causal; its bits against one CTA per tile, and the forward and non-finite suites with every launch on it.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent2.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage persistent_bits 170 python3 -m pytest -x -q -p no:cacheprovider -rfE \
  tests/kernels/test_cute_fwd_gpu.py -k persistent
FA4DIST_FWD_OVERRIDE=persistent_ctas=5 TAIL_LINES=4 stage nonfinite_persistent 100 python3 -m pytest -x -q \
  -p no:cacheprovider -rfE tests/kernels/test_cute_nonfinite_gpu.py -k forward
FA4DIST_FWD_OVERRIDE=persistent_ctas=132 TAIL_LINES=4 stage fwd_suite_persistent 230 python3 -m pytest -x -q \
  -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py -k "not persistent"
