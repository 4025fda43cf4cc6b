#!/usr/bin/env bash
# Thirty-ninth session (2026-12-05; prepared in the thirty-eighth, whose device calls were refused): the whole GPU
# suite once on the session's final commit (it holds the new GPU tests of the lse's gradient through the work lists
# and the ring), then the #11 table under today's defaults, the #15 window / sinks / softcap row, and two probes:
# - persistent: the persistent grid for the long dense causal backward at hdim 128 (one CTA per tile past 8k keys
#   today; the seventeenth session measured +1.2 / +1.9 / -1.7% at 16k, before the groups-of-4 order; the 16k row
#   is 0.98x flash-attn-4; predicted +0-2%: a CTA's next tile's loads overlap its last tile's dK / dV stores);
# - lse: the ring backward of a loss of out and lse (dlse in every step's row sums, one pass) against the plain
#   one, in the one-GPU simulation at 32k and cp 2 / 4; predicted the same efficiency as bwd (the single device's
#   dlse costs +1-4%, bench/lse_grad.py), where the second ring pass it replaces cost ~2x.
# One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_39.sh [tests] [table] [window] [persistent] [lse]
# (no argument: all five, in that order; flash-attn-4 carried: pack-cutedsl.sh --with-fa4). Ran in part in the
# thirty-ninth session on an H100 (tests, persistent; bench/RESULTS.md). Next: `tests_kernels`, then `tests_rest`
# (one call each), then `table window lse`.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s39 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
[ -n "${NO_BUNDLE:-}" ] || bundle_folders_on_exit
stages=${*:-tests table window persistent lse}
for s in $stages; do
  case $s in
    tests)  # (the whole suite ran past 330 s on an H100: 14 failures at 38%, unnamed; now in two calls' parts)
      TAIL_LINES=25 stage tests_all 330 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu -n 14 tests ;;
    tests_kernels)
      TAIL_LINES=25 stage tests_kernels 420 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=line -m gpu -n 14 \
        tests/kernels ;;
    tests_rest)
      TAIL_LINES=25 stage tests_rest 420 python3 -m pytest -q -p no:cacheprovider -rfExX --tb=line -m gpu -n 14 \
        tests --ignore=tests/kernels ;;
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
    lse)
      TAIL_LINES=12 stage lse 150 python3 bench/cp_sim.py --seqlens 32768 --cp 2 4 --balancers lpt \
        --directions bwd bwd_lse --reps 3 --queue-ahead-ms 8 --back-to-back --tag lse ;;
    *) echo "unknown stage $s (tests | tests_kernels | tests_rest | table | window | persistent | lse)"; exit 2 ;;
  esac
done
