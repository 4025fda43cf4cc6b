#!/usr/bin/env bash
# Thirty-eighth session (2026-12-05): the whole GPU suite once on the session's final commit (earlier sessions ran
# it in parts), then the #11 table under today's defaults, the #15 window / sinks / softcap row, and one probe: the
# persistent grid for the long dense causal backward at hdim 128 (one CTA per tile past 8k keys today; the
# seventeenth session measured +1.2 / +1.9 / -1.7% at 16k, before the groups-of-4 order; the 16k row is 0.98x
# flash-attn-4; predicted +0-2%: a CTA's next tile's loads overlap its last tile's dK / dV stores). One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_38.sh [tests] [table] [window] [persistent]
# (no argument: all four, in that order; flash-attn-4 carried: pack-cutedsl.sh --with-fa4).
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s38 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
stages=${*:-tests table window persistent}
for s in $stages; do
  case $s in
    tests)
      TAIL_LINES=25 stage tests_all 330 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu -n 14 tests ;;
    table)
      TAIL_LINES=20 stage table 200 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
        --causal false true --directions fwd bwd --deterministic --backends cute cudnn flash_attn_4 --rounds 3 \
        --out-dir "$OUT/table" ;;
    window)
      TAIL_LINES=12 stage window 100 python3 bench/window.py --rounds 3 --queue-ahead-ms 5 --out-dir "$OUT/window" ;;
    persistent)
      for v in default grid; do
        o=; [ "$v" = grid ] && o=persistent_ctas=132
        TAIL_LINES=6 FA4DIST_BWD_OVERRIDE=$o stage "persistent_$v" 80 python3 bench/split_tail.py --direction bwd \
          --causal --headdim 128 --shapes 1x16384x16 1x32768x8 2x16384x8 --rounds 3 --out-dir "$OUT/persistent_$v"
      done ;;
    *) echo "unknown stage $s (tests | table | window | persistent)"; exit 2 ;;
  esac
done
