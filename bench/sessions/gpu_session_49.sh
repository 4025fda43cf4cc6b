#!/usr/bin/env bash
# Prepared in the forty-fifth session (2026-12-05) for the next one. A call returns few files: run stages alone or
# in pairs.
# - marks_192: hdim 64's 192-row tiles with the deferred bad-V marks (FwdConfig.defer_v_marks, off there by default:
#   -1.2% at 4k and 16k in two H100 calls) on the H200 if lent, and the short kernels against the knob off again
#   (+1-2% on both cards): device time, beside cuDNN and flash-attn-4.
# - marks_packed_h200: packed 512 / 1024-token documents against the knob off (+2.0 / +1.6% on the H100).
# - scratch_host, handoff, fwd_long: as gpu_session_47.sh (scratch_host needs .kwt carried, a fresh machine).
# One call: source .devwheels/install.sh && bash bench/sessions/gpu_session_49.sh [marks_192] [marks_packed_h200] ...
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s49 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
for s in ${*:-marks_192}; do
  case $s in
    marks_192)
      TAIL_LINES=20 stage marks_192 270 python3 bench/kernels.py --headdims 64 --seqlens 4096 16384 \
        --causal false true --directions fwd --backends cute flash_attn_4 --cute-variants fwd:defer_v_marks=1 \
        --rounds 7 --queue-ahead-ms 3 --out-dir "$OUT/marks_192"
      TAIL_LINES=12 stage marks_short 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 2048 \
        --causal true --directions fwd --backends cute cudnn flash_attn_4 --cute-variants fwd:defer_v_marks=0 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/marks_short" ;;
    marks_packed_h200)
      TAIL_LINES=8 stage marks_packed 150 python3 bench/packed_tiles.py --doclen 512 1024 --rounds 5 \
        --queue-ahead-ms 3 --variants defer_v_marks=0 ;;
    scratch_host|handoff|fwd_long)
      NO_BUNDLE=1 bash "$(dirname "$0")/gpu_session_47.sh" "$s" ;;
    *) echo "unknown stage $s (marks_192 | marks_packed_h200 | scratch_host | handoff | fwd_long)"; exit 2 ;;
  esac
done
