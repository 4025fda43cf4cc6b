#!/usr/bin/env bash
# Sixty-seventh session's GPU calls (bench/RESULTS.md). Each part states its prediction.
# - elect: FwdConfig.elect_release (prepared in the sixty-sixth session, not run), the overlapped step's K / V
#   releases by elect.sync instead of the lane-0 predicate ptxas recomputes from %tid in every step. The
#   schedule-fields bits test, then hdim 64 / 128 forwards at 16k / 32k beside the default and flash-attn-4.
#   Predicted: the same bits; speed within +-1% (ptxas places the PV wait before the step's first exp2 there).
# - kvcache: flash_attn_with_kvcache's GPU tests on 9ee48cb's indexed write of the new rows (one write per cache,
#   was a copy per sequence), a paged cache (block_table) and flash-attn 4's paged varlen (page_table, seqused_*),
#   both new. Predicted: 8 passed.
# - table: #11's table (stage.sh kernels_table) if an H200 comes: none has been taken under the stored row max.
#   Predicted (H200): hdim 128 forward and backward >= 0.99x flash-attn-4, hdim-64 forward 0.97-0.99x.
# - elect_default: elect_release on by default for hdim-64 causal launches (calls 7-8: +0.9 to +2.0% there at
#   8k-32k; non-causal -0.4 to -1.0%): the hdim-64 forward GPU tests and the non-finite suite under it, and its speed
#   at 1k / 4k / 16k beside the knob off. Predicted: all pass; +0-2%.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_67.sh elect kvcache; elect_default
set -u
source "$(dirname "$0")/../stage.sh"
for s in ${*:-elect}; do
  case $s in
    elect)
      gpu_tests elect_bits 240 tests/kernels/test_cute_fwd_gpu.py -k "schedule_fields and elect_release"
      TAIL_LINES=10 stage elect_ab 300 python3 bench/kernels.py --headdims 64 128 --seqlens 16384 32768 \
        --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:elect_release=1 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/elect" ;;
    kvcache) gpu_tests kvcache 200 tests/compat/test_flash_attn_compat_gpu.py ;;
    table) kernels_table ;;
    elect_default)
      gpu_tests elect_tests 150 tests/kernels/test_cute_fwd_gpu.py tests/kernels/test_cute_nonfinite_gpu.py -k 64
      TAIL_LINES=6 stage elect_short 100 python3 bench/kernels.py --headdims 64 --seqlens 1024 4096 16384 \
        --causal true --directions fwd --backends cute cudnn flash_attn_4 --cute-variants fwd:elect_release=0 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/elect_short" ;;
    *) echo "unknown stage $s (elect | kvcache | table | elect_default)"; exit 2 ;;
  esac
done
