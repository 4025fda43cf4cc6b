#!/usr/bin/env bash
# One call on one H200 for the one-gradient backward variants (dq only, dk/dv only: the cp_invariant engine's two
# passes): their GPU test against the full backward's bytes, bench/kernels.py timing all / dq / dkv in
# deterministic accumulate mode, then the cp_invariant byte-equality tests with staged ranks.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_grads.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=4 stage grads_test 80 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k one_gradient
TAIL_LINES=12 stage grads_bench 60 python3 bench/kernels.py --headdims 128 --seqlens 16384 --causal true \
  --directions bwd --deterministic --backends cute --cute-variants bwd-det:grads=all bwd-det:grads=dq \
  bwd-det:grads=dkv --rounds 3 --out-dir "$OUT/grads"
TAIL_LINES=4 stage invariant_cp 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py \
  -k invariant
