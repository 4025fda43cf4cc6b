#!/usr/bin/env bash
# Prepared in the fourteenth session, for the next: a fresh table with every default of the fourteenth session
# (the forward's sum_from_old at hdim 64, the backward's early lse2 / dPsum reads at hdim 128), ours beside
# flash-attn-4 and cuDNN, deterministic too; three rounds. Then Nsight Compute's SASS-level samples of the
# hdim-128 forward at 16k (full), ours against flash-attn-4: on the CPU (bench/sass_softmax.py --fa4) our step
# waits for the PV GEMM before its first exp2 and flash-attn-4's after its 10th; the samples say what it costs.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_15.sh
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s15 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
TAIL_LINES=2 stage aot_fwd 120 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set fwd_bench
TAIL_LINES=2 stage aot_bwd 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 \
  --set early_vectors
TAIL_LINES=40 stage table 300 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
  --causal false true --directions fwd bwd --deterministic --backends cute sdpa_cudnn flash_attn_4 --rounds 3 \
  --out-dir "$OUT"
mv "$OUT/$(date +%F)-kernels.json" "$OUT/table.json" 2>/dev/null
rm -f "$OUT"/*.png
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for who in cute:fa4dist flash_attn_4:flash_attn; do
  b=${who%%:*} p=${who##*:}
  "$NCU" --profile-from-start off --clock-control none --section SourceCounters --section WarpStateStats \
    --import-source no -k "regex:$p" --launch-count 1 --export "/tmp/src_$b" -f \
    python3 bench/ncu_kernels.py --cases fwd:128:16384:full --backends "$b" > /dev/null 2>&1
  "$NCU" --import "/tmp/src_$b.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/sass_$b.csv.gz"
done
python3 bench/ncu_summary.py compare "$OUT/sass_cute.csv.gz" "$OUT/sass_flash_attn_4.csv.gz"
