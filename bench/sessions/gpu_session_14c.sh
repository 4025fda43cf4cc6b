#!/usr/bin/env bash
# Fourteenth session, third call: the forward's row sum started from the old, rescaled sum (softmax.py). The SASS-
# level counters of the hdim-64 forward (gpu_session_14b.sh) had our MUFUs waiting on a full MIO queue far more
# than flash-attn-4's (+20k mio samples), and our SASS put all the O rescale's FMULs after the row's last exp2
# (the factor's exp2 was off every critical path, so ptxas issued it last). Now they meet the first 8-29
# exponentials (ptxas, CPU). Prediction: hdim 64 forward +2-4% (flash-attn-4 runs 4% ahead with the same
# instruction counts), hdim 128 +1-2%; causal hdim 64 keeps its conditional rescale (threshold 8), so it is also
# timed with the rescale unconditional. Needs the previous commit's fa4dist in .kwt/base (carried):
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_14c.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/fb FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 8 --set fwd_bench
TAIL_LINES=2 stage aot_base 150 python3 .kwt/base/bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 8 \
  --set fwd_bench
TAIL_LINES=30 stage fwd 300 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 16384 --causal false true \
  --directions fwd --backends cute sdpa_cudnn flash_attn_4 --baseline-dir .kwt/base \
  --cute-variants d64:fwd:rescale_threshold=0.0 --rounds 3 --out-dir "$OUT"
mv "$OUT/$(date +%F)-kernels.json" "$OUT/fwd-sum-init.json" 2>/dev/null
rm -f "$OUT"/*.png
