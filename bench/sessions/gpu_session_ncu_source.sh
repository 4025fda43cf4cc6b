#!/usr/bin/env bash
# Thirteenth session, second profile: where the short causal backward's warps stall, instruction by instruction
# (Nsight Compute's source counters, SASS), ours against flash-attn-4's main kernel, hdim 128 causal 1k (the
# counters of gpu_session_ncu.sh had ours at 0.82x with more long-scoreboard, LG-throttle and short-scoreboard
# stalls, and dK/dV written with 1M plain global stores where flash-attn-4 issues TMA stores). One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_ncu_source.sh
set -u
source "$(dirname "$0")/../stage.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for who in cute:fa4dist flash_attn_4:flash_attn; do
  backend=${who%%:*} pattern=${who##*:}
  TAIL_LINES=3 stage "ncu_$backend" 150 "$NCU" --profile-from-start off --clock-control none \
    --section SourceCounters --section WarpStateStats --section LaunchStats --import-source no \
    -k "regex:$pattern" --launch-skip 1 --launch-count 1 --export "$OUT/src_$backend" -f \
    python3 bench/ncu_kernels.py --cases bwd:128:1024:causal --backends "$backend"
  "$NCU" --import "$OUT/src_$backend.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$backend.csv" 2>&1
  "$NCU" --import "$OUT/src_$backend.ncu-rep" --page details > "$OUT/details_$backend.txt" 2>&1
  rm -f "$OUT/src_$backend.ncu-rep"
done
ls -la "$OUT"
