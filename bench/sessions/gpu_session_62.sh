#!/usr/bin/env bash
# Sixty-second session's GPU calls (bench/RESULTS.md). Each part states its prediction.
# - table: #11's table (stage.sh kernels_table: hdim 128 / 64, 4k / 16k, causal and not, forward, backward and the
#   deterministic backward beside cuDNN and flash-attn-4; an H200, alone: 420 s), the first H200 table under the
#   row max stored in log2 units (57ff965). Predicted: every point within +-0.01 of the fifty-ninth's H200 table
#   (hdim-64 forward at 16k 0.97-0.98x flash-attn-4, the deterministic hdim-128 non-causal 16k backward 0.94-0.95x).
# - edges: the points the table leaves out, on the same kernels: the causal 1k forward and backward at hdim 64 and
#   128 beside cuDNN and flash-attn-4 (#11's short-document target: at least cuDNN), and the hdim-64 forward at 8k
#   and 32k. Predicted: causal 1k forward 0.95-1.0x cuDNN at hdim 64 (0.96x on the H100), >= 1.0x at hdim 128;
#   hdim-64 forward 0.97-0.99x flash-attn-4 at 8k / 32k.
# - health: the staged-rank context-parallel GPU suite and the whole backward GPU suite on main (neither has run whole
#   since the fifty-sixth to sixty-first sessions' kernel changes: the backward's ascending causal band and early
#   vectors, the forward's wide tiles and the stored row max, which the ring's merges run on). Predicted: all pass.
# Run in the sixty-second (bench/RESULTS.md), on one H100 each time (no H200 came): table (call 6), edges (call 7),
#   bench/window.py by hand (call 8), health (call 12; then the backends and peer GPU suites by hand, call 13).
#   Not run: table on an H200.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_62.sh table; then edges; health.
set -u
source "$(dirname "$0")/../stage.sh"
for s in ${*:-table}; do
  case $s in
    table) kernels_table ;;
    edges)
      TAIL_LINES=10 stage short 240 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 --causal true \
        --directions fwd bwd --backends cute cudnn flash_attn_4 --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/short"
      TAIL_LINES=6 stage fwd64 240 python3 bench/kernels.py --headdims 64 --seqlens 8192 32768 --causal false true \
        --directions fwd --backends cute cudnn flash_attn_4 --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/fwd64" ;;
    health)
      gpu_tests cp_tests 230 tests/cp/test_cp_gpu.py
      gpu_tests bwd_tests 330 tests/kernels/test_cute_bwd_gpu.py ;;
    *) echo "unknown stage $s (table | edges | health)"; exit 2 ;;
  esac
done
