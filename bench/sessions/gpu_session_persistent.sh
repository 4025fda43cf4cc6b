#!/usr/bin/env bash
# The persistent forward grid (FwdConfig.persistent_ctas): its bits against one CTA per tile, the non-finite and
# window suites on a 5-CTA persistent grid (many tiles per CTA), and its speed beside the default and the baselines.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_persistent.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage persistent_bits 200 python3 -m pytest -x -q -p no:cacheprovider -rfE \
  tests/kernels/test_cute_fwd_gpu.py -k persistent
TAIL_LINES=40 stage fwd_bench 260 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal false true --directions fwd --backends cute sdpa_cudnn flash_attn_4 \
  --cute-variants fwd:persistent_ctas=132 --rounds 3 --out-dir "$OUT"
FA4DIST_FWD_OVERRIDE=persistent_ctas=5 TAIL_LINES=4 stage nonfinite_persistent 100 python3 -m pytest -x -q \
  -p no:cacheprovider -rfE tests/kernels/test_cute_nonfinite_gpu.py
