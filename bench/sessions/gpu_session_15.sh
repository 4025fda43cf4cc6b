#!/usr/bin/env bash
# Prepared in the fourteenth session, for the next. Two calls:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_15.sh 1   # late_pv_wait, then the fresh table
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_15.sh 2   # the hdim-128 forward's SASS samples
# 1: FwdConfig.late_pv_wait (flash-attn-4's forms: the K / V barriers tried once before the blocking wait, P
#    converted with inline cvts): on the CPU (bench/sass_softmax.py) ptxas then puts the hdim-128 step's PV wait
#    after the 12th exp2 instead of before the first (flash-attn-4: the 10th), hdim 64 causal after the 11th-12th;
#    hdim 64 non-causal unchanged. Prediction: hdim 128 forward +1-3% at 4k-16k, hdim 64 causal +1-2%, hdim 64
#    non-causal within noise. The knob beside the default (and at hdim 128 with sum_from_old, which lost 2-5%
#    alone, and with both lands next to flash-attn-4's schedule), flash-attn-4 and cuDNN beside; then a fresh
#    table with this session's defaults, deterministic backward too.
# 2: Nsight Compute's SASS-level samples of the hdim-128 forward at 16k (full), ours against flash-attn-4.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s15 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=2 stage aot_fwd 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set fwd_bench
  TAIL_LINES=2 stage aot_tw 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 --set try_wait
  TAIL_LINES=2 stage aot_bwd 150 python3 bench/cute_session_dev.py aot "$FA4DIST_CUTE_AOT_DIR" --jobs 16 \
    --set early_vectors
  TAIL_LINES=20 stage try_wait 150 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
    --causal false true --directions fwd --backends cute sdpa_cudnn flash_attn_4 --cute-variants \
    fwd:late_pv_wait=true d128:fwd:late_pv_wait=true,sum_from_old=true --rounds 3 --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/try-wait.json" 2>/dev/null
  TAIL_LINES=40 stage table 240 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
    --causal false true --directions fwd bwd --deterministic --backends cute sdpa_cudnn flash_attn_4 --rounds 3 \
    --out-dir "$OUT"
  mv "$OUT/$(date +%F)-kernels.json" "$OUT/table.json" 2>/dev/null
  rm -f "$OUT"/*.png
  exit
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for who in cute:fa4dist flash_attn_4:flash_attn; do
  b=${who%%:*} p=${who##*:}
  "$NCU" --profile-from-start off --clock-control none --section SourceCounters --section WarpStateStats \
    --import-source no -k "regex:$p" --launch-count 1 --export "/tmp/src_$b" -f \
    python3 bench/ncu_kernels.py --cases fwd:128:16384:full --backends "$b" > /dev/null 2>&1
  "$NCU" --import "/tmp/src_$b.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/sass_$b.csv.gz"
done
python3 bench/ncu_summary.py compare "$OUT/sass_cute.csv.gz" "$OUT/sass_flash_attn_4.csv.gz"
