#!/usr/bin/env bash
# Prepared in the twentieth session, after gpu_session_19.sh 5 made the cap's derivative in registers the default
# at hdim 128 (+6% on the non-deterministic causal backward at 4k / 16k, 8 bytes of spills):
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_21.sh 1
# 1: the softcap kernels' GPU tests under the new default; the soft-capped hdim-128 backward, causal or not,
#    deterministic or not, against the P path (the deterministic causal kernel spills 20 bytes, the windowed one 32:
#    prediction +3-6% there too, +2-4% non-causal, which does not spill); then bench/window.py (the cost of the
#    options against the causal row beside flash-attn-4's: softcap fwd+bwd was +17-18%, predicted ~+11-12% now).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s21 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE"
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session21
  TAIL_LINES=6 stage tests 240 $PYTEST -n 8 tests/kernels/test_window_gpu.py tests/kernels/test_cute_bwd_gpu.py \
    -k "cap or window"
  TAIL_LINES=14 stage softcap_ab 150 python3 bench/kernels.py --headdims 128 --seqlens 4096 16384 \
    --causal false true --directions bwd --deterministic --softcap 30 --backends cute \
    --cute-variants bwd:softcap_grad_regs=false --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/softcap-grad-regs-ab.json" 2>/dev/null
  TAIL_LINES=9 stage window 150 python3 bench/window.py --rounds 3 --out-dir "$OUT"
  rm -f "$OUT"/*.png
  exit
fi
