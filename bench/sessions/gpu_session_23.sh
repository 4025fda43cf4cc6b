#!/usr/bin/env bash
# Prepared in the twenty-second session (2026-12-03), results in bench/results/2026-12-03-twenty-second-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_23.sh 1   # cp_invariant's one-device passes
# 1: one device's cp_invariant backward writes its gradients (accumulate=False: dq converted straight into bf16,
#    dK / dV stored in bf16 plus +0, no fp32 buffers, zero fills or casts), the K / V maxima in two reductions
#    without a copy, the forward's fp32 out not zero-filled. Bits first (the kernel's written form against the
#    accumulating one; the staged-rank layouts against one device), then the step beside the previous commit's
#    (.kwt/inv: `git archive 1202321 fa4dist`) and a profile. Prediction: -1.5 to -2 ms of the ~10 ms over plain
#    at 32 / 32 heads (fills 4 x 0.18, casts 3 x 0.18, the dK / dV epilogue's fp32 reads, the copies 2 x 0.13),
#    1.21x -> ~1.17-1.18x plain; at 32 / 8 less (dK / dV stay fp32 per query head).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=4 stage tests_bwd 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 tests/kernels/test_cute_bwd_gpu.py \
    -k "fixed_point"
  TAIL_LINES=4 stage tests_cp 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py -k invariant
  TAIL_LINES=60 stage invariant 330 python3 bench/invariant.py --tokens 32768 --heads 32:32 32:8 --reps 5 \
    --baseline-dir .kwt/inv --profile --out-dir "$OUT"
  exit
fi
# 2: call 1 measured the step at 1.192x plain (32 / 32; the previous commit 1.223x in the same run), and its profile
#    put the four maxima of the scales at 1.36 ms (the row reductions over d at ~0.8 TB/s). Which torch form of a
#    row maximum reads fastest (bench/scale_maxima.py; every form gives the same values). Prediction: a two-stage
#    form (over 8 contiguous elements, then the partial maxima) near the read bandwidth, 3-4x the current one.
if [ "$1" = 2 ]; then
  TAIL_LINES=20 stage maxima 120 python3 bench/scale_maxima.py --tokens 32768 --heads 32 --headdim 128 --out-dir "$OUT"
  TAIL_LINES=20 stage maxima64 120 python3 bench/scale_maxima.py --tokens 32768 --heads 32 --headdim 64 --out-dir "$OUT/d64"
  exit
fi
# 3: the scales' maxima by a row kernel of our own (cute/row_absmax.py: 16-byte loads, the max on the bits,
#    head_dim / 8 threads per row; fixed_point.absmax over the last dim and head_absmax take it). Bits first (its
#    values against torch's, NaN / inf planted; the cp_invariant tests), then bench/scale_maxima.py and the step
#    beside the commit before it (.kwt/prev: 141832d, which has the group sums' fused rounding too) and beside
#    1202321 (.kwt/inv). Prediction: each row maximum ~70-90 us (3-4 TB/s) against ~300; the step -0.8 to -1 ms at
#    32 / 32 (1.19x -> ~1.17x plain); at 32 / 8 also the group sums' -0.4 ms against 1202321.
if [ "$1" = 3 ]; then
  TAIL_LINES=4 stage tests 240 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 tests/kernels/test_row_absmax_gpu.py \
    tests/kernels/test_cute_bwd_gpu.py -k "row or fixed_point"
  TAIL_LINES=4 stage tests_cp 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/cp/test_cp_gpu.py -k invariant
  TAIL_LINES=16 stage maxima 120 python3 bench/scale_maxima.py --tokens 32768 --heads 32 --headdim 128 --out-dir "$OUT"
  TAIL_LINES=24 stage invariant_prev 300 python3 bench/invariant.py --tokens 32768 --heads 32:32 32:8 --reps 5 \
    --baseline-dir .kwt/prev --out-dir "$OUT/prev"
  TAIL_LINES=24 stage invariant_start 300 python3 bench/invariant.py --tokens 32768 --heads 32:32 32:8 --reps 5 \
    --baseline-dir .kwt/inv --profile --out-dir "$OUT/start"
  exit
fi
# 4: after the contract's hardening (accumulate / return_lse checked as bools, an empty batch, the work lists'
#    whole buffers): the GPU suites of the contract, the backends, the work lists and torch.compile, and the
#    CP GPU tests (staged ranks), under one limit each.
if [ "$1" = 4 ]; then
  TAIL_LINES=6 stage tests_backends 280 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_backends_gpu.py tests/kernels/test_worklist_gpu.py tests/kernels/test_torch_compile.py \
    tests/kernels/test_nonfinite.py
  TAIL_LINES=6 stage tests_cp 250 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/cp/test_cp_gpu.py
  exit
fi
