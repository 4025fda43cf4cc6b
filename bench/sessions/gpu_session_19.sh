#!/usr/bin/env bash
# Prepared in the eighteenth session for the next one: the suites and the kernel table under the current defaults
# (chained_max for dense non-causal hdim-128 launches of 8k+ keys; permuted_vectors removed), so that the issue's
# table is one run of the final code.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_19.sh 1   # kernel GPU suites (defaults)
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_19.sh 2   # the table beside cuDNN and FA4
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_19.sh 3   # SASS samples, det 16k hdim-128 bwd
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_19.sh 4   # the dQ tickets' forms: bits, A/B
# 3: the deterministic non-causal hdim-128 backward at 16k is 0.93-0.95x flash-attn-4's deterministic one while
#    the non-deterministic one is 0.99: our determinism costs ~7%, theirs ~2.5%. At 16k the ascending ticket order's
#    first-wave skew is ~2% by count (NOTES_BWD, tenth session), so where the rest waits is the question: the dQ
#    writer's acquire / bulk add / completion wait / release chain against the step time, or the MMA warps on the
#    dQ smem buffer. Nsight Compute's SASS samples of both deterministic main kernels say which instructions wait.
# 4: the dQ writer's ticket chain in flash-attn-4's form (BwdConfig.ticket_sleep_ns=0: the poll spins instead of
#    sleeping 32 ns a read; release_fence=False: red.release alone, which is a release itself: the default's SASS
#    has two MEMBAR.ALL.GPU per step before the RED, flash-attn-4's one). Same order of adds, so the same bits:
#    the bits test first, then the deterministic rows with the fence dropped, and with both. Prediction: the fence
#    alone +1-3% on the deterministic backward at 4k-16k (one GPU-wide barrier less on the chain every step), the
#    spin another 0-2%; nothing on the non-deterministic rows (they have no tickets).
# 5: (added after 4 made release_fence=False the default) the dQ buffer freed once a step's adds have read it,
#    the ticket released after (BwdConfig.early_dq_free): the samples of 3 had the MMA warps' dQ smem store waiting
#    on the buffer's empty barrier, which the writer arrived only after the previous step's adds landed and its
#    ticket was released. Same order of adds: the bits test first. Prediction: deterministic rows +1-3% at 4k-16k
#    (the landing and release leave the MMA warps' path), nothing at 1k. With it, a second dQ buffer in the dK / dV
#    staging tile (BwdConfig.dq_stages = 2; hdim 128, one CTA per tile, so the 4k non-deterministic rows, which run
#    on the persistent grid, keep one buffer): the MMA warps then wait for the add of two steps back. Prediction:
#    another +1-2% on the deterministic rows, 0-1% on the non-deterministic 16k ones. Then the soft-capped causal hdim-128
#    backward with the cap's derivative in registers: it spills 8 bytes now (20 when measured +3-5% on 2026-12-01).
#    (Run in the twentieth session; early_dq_free, dq_stages and the session19b set were removed after it.)
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s19 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE"
if [ "$1" = 4 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session19
  TAIL_LINES=4 stage bits 120 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py -k "ticket_forms"
  TAIL_LINES=30 stage ab 300 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
    --causal false true --directions bwd --deterministic --backends cute flash_attn_4 \
    --cute-variants bwd-det:release_fence=false "bwd-det:ticket_sleep_ns=0,release_fence=false" --rounds 5 \
    --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/ticket-forms-ab.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 5 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session19b
  TAIL_LINES=4 stage bits 150 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py -k "ticket_forms or second_dq_buffer"
  # the A/B only if every bits test passed (pytest's last line: "N passed[, M warnings] in T s")
  tail -n 1 "$OUT/bits.log" | grep -q " passed" && ! tail -n 1 "$OUT/bits.log" | grep -qE "failed|error" || exit 1
  TAIL_LINES=30 stage ab 240 python3 bench/kernels.py --headdims 128 64 --seqlens 4096 16384 \
    --causal false true --directions bwd --deterministic --backends cute flash_attn_4 \
    --cute-variants bwd-det:early_dq_free=true bwd:dq_stages=2 "bwd-det:dq_stages=2,early_dq_free=true" \
    --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/early-dq-free-ab.json" 2>/dev/null
  TAIL_LINES=8 stage softcap 120 python3 bench/kernels.py --headdims 128 --seqlens 4096 16384 --causal true \
    --directions bwd --softcap 30 --backends cute --cute-variants bwd:softcap_grad_regs=true --rounds 3 \
    --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/softcap-grad-regs-ab.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=4 stage fwd 240 $PYTEST -n 8 tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_cute_nonfinite_gpu.py
  TAIL_LINES=4 stage bwd 300 $PYTEST -n 8 tests/kernels/test_cute_bwd_gpu.py
  exit
fi
if [ "$1" = 2 ]; then
  TAIL_LINES=2 stage aot 200 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set table
  TAIL_LINES=40 stage table 360 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
    --causal false true --directions fwd bwd --deterministic --backends cute sdpa_cudnn flash_attn_4 --rounds 3 \
    --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/table.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
if [ "$1" = 3 ]; then
  ncu_sass_pair bwd:128:16384:full:det FlashBwdSm90 FlashAttentionBackwardSm90
  exit
fi
