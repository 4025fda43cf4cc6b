#!/usr/bin/env bash
# Sixty-sixth session's GPU calls (bench/RESULTS.md). Each part states its prediction.
# - inv_window: the staged-rank cp_invariant GPU tests, among them the windowed case the sixty-fifth session added
#   (window (300, -1): each row's fixed-point dq bound from the keys inside its window, the sparse-table path of
#   fixed_point.visible_key_bounds), never run on a GPU; and the single device's invariant suite. Predicted: all pass.
# - table: #11's table (stage.sh kernels_table) on whatever card comes; the H200's under the stored row max has not
#   been taken. Predicted (H200): hdim 128 forward and backward >= 0.99x flash-attn-4, hdim-64 forward at 16k
#   0.97-0.99x; (H100): within +-0.01 of the sixty-second session's rows.
# - grid: the backward's pre- and postprocess on a one-dimensional grid of (tile, sequence) (row_tile_grid; a batch
#   of 70000 sequences failed to launch: bench/sessions/s66_grid_probe.py, call 7), and every backward GPU test and
#   the staged-rank cp suite on it. Predicted: all pass, the 70000-sequence cases among them.
# - elect (prepared, not run: the session's device time ran out): FwdConfig.elect_release, the overlapped step's K / V
#   releases by elect.sync instead of the lane-0 predicate that ptxas recomputes from %tid in every step (one S2R a
#   step at hdim 64; flash-attn-4's loop has none). The schedule-fields bits test, then hdim 64 / 128 forwards at
#   16k / 32k beside the default and flash-attn-4. Predicted: the same bits; speed within +-1% (ptxas now places the
#   PV wait before the step's first exp2, where the default has it after the ninth: that may cost what the S2R gave).
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_66.sh inv_window; then table; grid; elect.
set -u
source "$(dirname "$0")/../stage.sh"
for s in ${*:-inv_window}; do
  case $s in
    inv_window)
      gpu_tests inv_tests 300 tests/cp/test_cp_gpu.py tests/kernels/test_invariant_gpu.py -k "invariant or keys_it" ;;
    table) kernels_table ;;
    grid) gpu_tests grid_tests 560 tests/kernels/test_cute_bwd_gpu.py tests/cp/test_cp_gpu.py ;;
    elect)
      gpu_tests elect_bits 240 tests/kernels/test_cute_fwd_gpu.py -k "schedule_fields and elect_release"
      TAIL_LINES=10 stage elect_ab 300 python3 bench/kernels.py --headdims 64 128 --seqlens 16384 32768 \
        --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:elect_release=1 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/elect" ;;
    *) echo "unknown stage $s (inv_window | table | grid | elect)"; exit 2 ;;
  esac
done
