#!/usr/bin/env bash
# Thirteenth session: torch.compile over the cute kernels (the custom ops of kernels/torch_ops.py), then the first
# hardware counters of our kernels beside flash-attn-4's (Nsight Compute, one call of each case; bench/ncu_kernels.py)
# where the timing ratios trail: the short causal backward, the non-causal hdim 128 backward at 4k, the causal hdim
# 128 forward at 16k, the hdim 64 forward at 16k. One call:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_ncu.sh
set -u
source "$(dirname "$0")/../stage.sh"
TAIL_LINES=6 stage compile_test 200 python3 -m pytest -q -p no:logging tests/kernels/test_torch_compile.py
TAIL_LINES=12 stage compile_probe 120 python3 bench/compile_probe.py --backends cute
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
TAIL_LINES=14 stage ncu 300 "$NCU" --profile-from-start off --clock-control none --set full --import-source no \
  --export "$OUT/prof" -f python3 bench/ncu_kernels.py --cases bwd:128:1024:causal bwd:128:4096:full \
  fwd:128:16384:causal fwd:64:16384:full bwd:64:1024:causal
"$NCU" --import "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
"$NCU" --import "$OUT/prof.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2>&1
ls -la "$OUT"
