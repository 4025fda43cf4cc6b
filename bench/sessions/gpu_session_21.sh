#!/usr/bin/env bash
# Prepared in the twentieth session, after gpu_session_19.sh 5 made the cap's derivative in registers the default
# at hdim 128 (+6% on the non-deterministic causal backward at 4k / 16k, 8 bytes of spills):
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_21.sh 1
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_21.sh 2   # the deterministic GQA forms
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_21.sh 3   # suites and GQA table, new defaults
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
# 2: the deterministic GQA backward in three forms (backward.launch_steps det_dq): the ticketed GQA kernel (each CTA
#    walks its group's heads: the launch's longest CTAs are group times longer), the int64 dQ (today's default for
#    hdim-128 GQA from 16k), and K / V expanded per query head with the group's dK / dV summed after (every CTA one
#    head long). gpu_session_20.sh 1 measured the expanded form's kernel at 32k, 32 / 8 heads: 42.2 ms against 49.2
#    (int64) and 53.4 (GQA tickets), without the copies and the sum. Prediction: expanded 5-12% faster than the
#    default at 16k-32k hdim 128, ahead of the GQA tickets at hdim 64 too; within 2% at 4k. The GPU test first.
if [ "$1" = 2 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set det_gqa
  TAIL_LINES=4 stage tests 200 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py -k "gqa"
  TAIL_LINES=30 stage det_gqa 300 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 32768 \
    --total-tokens 32768 --kv-group 4 --causal false true --directions bwd --deterministic \
    --backends cute flash_attn_4 --cute-variants bwd-det:det_dq=expanded bwd-det:det_dq=tickets \
    bwd-det:det_dq=fixed --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/det-gqa.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
# 3: after 2 made the expanded heads the default for long causal GQA calls (backward.deterministic_gqa_form) and
#    the GQA tickets everywhere else (the int64 dQ was slowest at every point): the backward and work-list GPU
#    suites, then the GQA table under the new defaults beside flash-attn-4 (the defaults should match 2's best column).
if [ "$1" = 3 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set det_gqa
  TAIL_LINES=6 stage tests 300 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py tests/kernels/test_worklist_gpu.py
  TAIL_LINES=28 stage det_gqa 200 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 32768 \
    --total-tokens 32768 --kv-group 4 --causal false true --directions bwd --deterministic \
    --backends cute flash_attn_4 --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/det-gqa-defaults.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
