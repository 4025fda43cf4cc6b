#!/usr/bin/env bash
# Sixty-eighth session's GPU calls (bench/RESULTS.md). Each part states its prediction.
# - table: #11's table (stage.sh kernels_table), wanted on an H200: none has been taken there under the stored row
#   max (sixty-first session) and elect_release for hdim-64 causal (sixty-seventh). Predicted (H200): hdim 128
#   forward and backward >= 0.99x flash-attn-4, hdim-64 forward 0.98-0.99x, deterministic >= 0.95x except hdim-128
#   non-causal 16k at the edge.
# - short: #11's causal 1k points beside cuDNN (forward, and forward+backward), five rounds. Predicted: hdim 128
#   >= 1.0x cuDNN, hdim 64 0.95-0.97x.
# - late: FwdConfig.late_k_release (new, off): the overlapped step's stages released by the tile's elect.sync winner
#   (a predicate held through the loop: no S2R, no ELECT a step) and the K release after the step's softmax,
#   predicated on one of its exponentials (common_sm90.true_after), which keeps it and the PV wait among the
#   exponentials (ptxas, CPU: hdim-64 PV wait after exp2 #10 against #9 by default and #0 with elect_release; 411
#   instructions a step against 412). The bits test, then hdim 64 / 128 forwards at 1k / 4k / 16k beside the defaults
#   and flash-attn-4. Predicted: the same bits; hdim-64 non-causal +0.5 to +1.5%, hdim-64 causal -1 to +1% (its
#   default has elect_release's PV wait before the first exp2), hdim 128 0 to +0.5%.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_68.sh late table short
set -u
source "$(dirname "$0")/../stage.sh"
for s in ${*:-table}; do
  case $s in
    late)
      gpu_tests late_bits 240 tests/kernels/test_cute_fwd_gpu.py -k "schedule_fields and late_k_release"
      TAIL_LINES=12 stage late_ab 330 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 16384 \
        --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:late_k_release=1 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/late" ;;
    table) kernels_table ;;
    short)
      TAIL_LINES=8 stage short 150 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 \
        --causal true --directions fwd bwd --backends cute cudnn flash_attn_4 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/short" ;;
    *) echo "unknown stage $s (late | table | short)"; exit 2 ;;
  esac
done
