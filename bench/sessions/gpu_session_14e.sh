#!/usr/bin/env bash
# Fourteenth session, fifth call: BwdConfig.early_vectors by default (backward.default_early_vectors: hdim 128,
# dense fresh calls, non-causal or deterministic). The loads only move, so its bits must equal the kernel
# without it (test_early_vectors_give_the_same_bits), and the dense and deterministic backward tests against the
# fp64 oracle run on the new defaults.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_14e.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/ev FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set early_vectors
TAIL_LINES=6 stage bwd_tests 300 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k "early_vectors or test_dense or deterministic_matches or deterministic_bitwise or rotated"
wc -l "$OUT/compiled.txt" 2>/dev/null
# the rest of the forward suite (the fourth call ran its first 81 tests, all passed, before the stage's limit)
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/sfo
python3 -m pytest --co -q -p no:cacheprovider tests/kernels/test_cute_fwd_gpu.py 2>/dev/null | grep "::" | tail -n +82 \
  > "$OUT/fwd_rest_ids.txt"
TAIL_LINES=4 stage fwd_rest 150 python3 -m pytest -x -q -p no:cacheprovider -rfE $(cat "$OUT/fwd_rest_ids.txt")
