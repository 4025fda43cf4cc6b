#!/usr/bin/env bash
# Thirty-eighth session (2026-12-05): the whole GPU suite once on the session's final commit (earlier sessions ran
# it in parts), then the #11 table under today's defaults and the #15 window / sinks / softcap row. One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_38.sh [tests] [table] [window]
# (no argument: all three, in that order; flash-attn-4 carried: pack-cutedsl.sh --with-fa4).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s38 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
stages=${*:-tests table window}
for s in $stages; do
  case $s in
    tests)
      TAIL_LINES=25 stage tests_all 380 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu -n 14 tests ;;
    table)
      TAIL_LINES=20 stage table 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
        --causal false true --directions fwd bwd --deterministic --backends cute cudnn flash_attn_4 --rounds 3 \
        --out-dir "$OUT/table" ;;
    window)
      TAIL_LINES=12 stage window 100 python3 bench/window.py --rounds 3 --queue-ahead-ms 5 --out-dir "$OUT/window" ;;
    *) echo "unknown stage $s (tests | table | window)"; exit 2 ;;
  esac
done
