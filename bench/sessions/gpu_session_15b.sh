#!/usr/bin/env bash
# Fifteenth session, second call. FwdConfig.late_pv_wait is a default now (forward.default_late_pv_wait: all but
# hdim <= 64 causal): its bits test and the forward suites under the new defaults. And BwdConfig.try_waits (the
# same forms in the backward's step: the Q / dO waits tried before they block, P^T / dS^T converted with inline
# cvts): its bits test and the backward bench rows beside the default, flash-attn-4 beside.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_15b.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s15b FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
PYTEST="python3 -m pytest -x -q -p no:cacheprovider -rfE"
TAIL_LINES=2 stage aot 120 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session15
TAIL_LINES=4 stage bits 90 $PYTEST tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_cute_bwd_gpu.py \
  -k "late_pv_wait or step_forms"
TAIL_LINES=40 stage bwd 170 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 --causal false true \
  --directions bwd --deterministic --backends cute flash_attn_4 --cute-variants bwd:try_waits=true \
  bwd-det:try_waits=true --rounds 3 --out-dir "$OUT"
mv "$OUT/$(date +%F)-kernels.json" "$OUT/bwd-try-waits.json" 2>/dev/null
TAIL_LINES=2 stage aot_suite 100 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 \
  --set fresh:bench/results/2026-12-02-fourteenth-compiled-suites.txt
TAIL_LINES=4 stage fwd_suite 120 $PYTEST tests/kernels/test_cute_fwd_gpu.py
rm -f "$OUT"/*.png
