#!/usr/bin/env bash
# Fourteenth session, fourth call: FwdConfig.sum_from_old (the row sum starts from the old, rescaled one), on by
# default at hdim 64 with the O rescale unconditional there (rescale_threshold 0, causal too). The forward suites
# under the new defaults, then the bench against the previous commit (.kwt/base, carried) with the knob flipped
# per head dim (hdim 64 off: the old sum order with the new threshold; hdim 128 on), flash-attn-4 beside.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_14d.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/sfo FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set sum_from_old
TAIL_LINES=2 stage aot_base 100 python3 .kwt/base/bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 8 \
  --set fwd_bench
TAIL_LINES=30 stage fwd 200 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 16384 --causal false true \
  --directions fwd --backends cute flash_attn_4 --baseline-dir .kwt/base \
  --cute-variants d64:fwd:sum_from_old=false d128:fwd:sum_from_old=true --rounds 3 --out-dir "$OUT"
mv "$OUT/$(date +%F)-kernels.json" "$OUT/fwd-sum-from-old.json" 2>/dev/null
TAIL_LINES=4 stage fwd_suite 150 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py
TAIL_LINES=4 stage nonfinite 60 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_nonfinite_gpu.py
TAIL_LINES=4 stage worklist 60 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_worklist_gpu.py
rm -f "$OUT"/*.png
