#!/usr/bin/env bash
# One H200, after the fixed-point dQ's row scales moved below the dQ GEMM (bwd_sm90.mma_step): its GPU tests and
# the cp_invariant byte-equality tests; the hdim-64 deterministic backward with the chunked launch order
# (det_chunk=8) beside the default; what cp_invariant costs at hdim 64 now (bench/invariant.py).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_bwd_tile128c.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=4 stage fixed_tests 120 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/kernels/test_cute_bwd_gpu.py \
  -k "fixed_point or one_gradient or deterministic"
TAIL_LINES=4 stage invariant_tests 100 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py -k invariant
TAIL_LINES=16 stage det_bench 100 python3 bench/kernels.py --headdims 64 --seqlens 1024 4096 16384 --causal false true \
  --directions bwd --deterministic --backends cute flash_attn_4 --cute-variants d64:bwd-det:det_chunk=8 --rounds 3 \
  --warmup-ms 10 --rep-ms 30 --out-dir "$OUT"
TAIL_LINES=12 stage invariant_bench 100 python3 bench/invariant.py --tokens 32768 --heads 32:8 --headdim 64 --reps 5
