#!/usr/bin/env bash
# Fourteenth session, second call: where the hdim-64 forward's warps wait, instruction by instruction (Nsight
# Compute's source counters, SASS), ours against flash-attn-4 at 16k non-causal (0.97x; tensor pipe 50.9% against
# 57.5% in the thirteenth session's counters, the variants of gpu_session_14.sh all within noise); then the
# early lse2 / dPsum reads again (a second sample: +2-4% non-causal, -2% causal 4k in the first).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_14b.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s14 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set session14
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for who in cute:fa4dist flash_attn_4:flash_attn; do
  backend=${who%%:*} pattern=${who##*:}
  TAIL_LINES=3 stage "ncu_$backend" 150 "$NCU" --profile-from-start off --clock-control none \
    --section SourceCounters --section WarpStateStats --section LaunchStats --section InstructionStats \
    --import-source no -k "regex:$pattern" --launch-count 1 --export "$OUT/src_$backend" -f \
    python3 bench/ncu_kernels.py --cases fwd:64:16384:full --backends "$backend"
  "$NCU" --import "$OUT/src_$backend.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/sass_$backend.csv.gz"
  "$NCU" --import "$OUT/src_$backend.ncu-rep" --page details > "$OUT/details_$backend.txt" 2>&1
  rm -f "$OUT/src_$backend.ncu-rep"
done
TAIL_LINES=16 stage bwd 200 python3 bench/kernels.py --headdims 128 --seqlens 1024 4096 16384 --causal false true \
  --directions bwd --deterministic --backends cute flash_attn_4 --cute-variants bwd:early_vectors=true \
  bwd-det:early_vectors=true --rounds 3 --out-dir "$OUT"
mv "$OUT/$(date +%F)-kernels.json" "$OUT/bwd-early-vectors-2.json" 2>/dev/null
rm -f "$OUT"/*.png
ls -la "$OUT"
