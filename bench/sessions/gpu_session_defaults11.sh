#!/usr/bin/env bash
# The eleventh session's new defaults on the GPU: the rotated deterministic order for fresh non-causal gradients
# (backward.default_det_resident) and hdim 96's causal forward on the persistent grid with 32 producer registers
# (forward.default_regs_producer). The backward suite (its bits tests of the persistent grid included), the
# deterministic and windowed suites, hdim 96's forward tests, then the speed rows beside flash-attn-4. One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_defaults11.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/defaults11 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot_bwd 120 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set persistent_bwd
TAIL_LINES=2 stage aot_all 100 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set all
TAIL_LINES=6 stage bwd_suite 170 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py
TAIL_LINES=6 stage det_suites 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_backends_gpu.py \
  tests/kernels/test_window_gpu.py -k "deterministic"
TAIL_LINES=6 stage d96_fwd 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cute_fwd_gpu.py -k "d96 or 96"
TAIL_LINES=30 stage bench 110 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 --causal false \
  --directions bwd --deterministic --backends cute flash_attn_4 --cute-variants bwd-det:det_resident=false \
  --rounds 3 --warmup-ms 15 --rep-ms 60 --out-dir "$OUT"
TAIL_LINES=8 stage d96_bench 60 python3 bench/kernels.py --headdims 96 --seqlens 1024 4096 16384 --causal true \
  --directions fwd --backends cute sdpa_cudnn flash_attn_4 --cute-variants fwd:persistent_ctas=0,regs_producer=0 \
  --rounds 3 --out-dir "$OUT"
