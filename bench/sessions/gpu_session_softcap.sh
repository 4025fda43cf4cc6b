#!/usr/bin/env bash
# One call on one H200 for soft-capping: the forward's fixed row max (cute/softmax.softcap_fixed_row_max) and the
# backward's cap derivative kept in fp16 registers (softcap_grad_fp16) or recovered from P (softcap_grad_from_p).
# The variants compiled ahead of time in parallel, the softcap and sinks GPU tests (the backward under both
# derivative paths), bench/window.py (softcap and sinks cost against causal, windows, beside flash-attn-4), and
# bench/kernels.py with the other variant of each beside the default.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_softcap.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=${FA4DIST_CUTE_AOT_DIR:-/tmp/fa4dist-aot}
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 14 --set softcap
TAIL_LINES=8 stage softcap_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py \
  -k "cute and (softcap or sinks)"
for regs in 0 1; do
  FA4DIST_BWD_OVERRIDE="softcap_grad_regs=$regs" TAIL_LINES=4 stage "softcap_bwd_regs$regs" 150 python3 -m pytest -q \
    -p no:cacheprovider -rfE tests/kernels/test_window_gpu.py -k "cute and softcap_kernels"
done
TAIL_LINES=12 stage window_bench 110 python3 bench/window.py --out-dir "$OUT/window"
TAIL_LINES=10 stage kernels_softcap_bwd 120 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
  --causal true --directions bwd --softcap 30 --backends cute flash_attn_4 \
  --cute-variants bwd:softcap_grad_regs=true bwd:softcap_grad_regs=false --rounds 3 --out-dir "$OUT/softcap_bwd"
TAIL_LINES=10 stage kernels_softcap_fwd 100 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
  --directions fwd --softcap 50 --backends cute flash_attn_4 --cute-variants fwd:softcap_fixed_max=false \
  --rounds 3 --out-dir "$OUT/softcap50"
