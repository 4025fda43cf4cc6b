#!/usr/bin/env bash
# The dynamic persistent grid as the default of dense 16-bit forward launches, causal included: the forward,
# non-finite, window / softcap / sinks suites on it, then the speed table against one CTA per tile and baselines.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_dynamic_tiles4.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=4 stage fwd_suite 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py \
  -k "not persistent_grid"
TAIL_LINES=4 stage nonfinite_fwd 60 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/kernels/test_cute_nonfinite_gpu.py -k "forward_dense or fp16_dense or lse_is_nan or see_no_key"
TAIL_LINES=4 stage window_fwd 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py \
  -k "cute and (dense_windows or garbage or between_two or softcap_kernels or fixed_row_max or sinks_in)"
TAIL_LINES=10 stage fwd_bench 110 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal false true --directions fwd --backends cute sdpa_cudnn flash_attn_4 \
  --cute-variants fwd:persistent_ctas=0 --rounds 3 --out-dir "$OUT"
