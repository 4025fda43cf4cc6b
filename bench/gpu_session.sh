#!/usr/bin/env bash
# One call on the GPU machine: the kernel benchmark (ours beside cuDNN, torch flash and flash-attn-4), the GPU
# tests of the contract and of CP, the ring simulation and the FSDP2 recipe at 32k.  Every stage has a time limit
# so one stuck stage cannot eat the call; logs and JSON go to $OUT.
#   source .devwheels/install.sh && bash bench/gpu_session.sh
set -u
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stage() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0))s"
  tail -n "${TAIL_LINES:-40}" "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
stage kernels 190 python3 bench/kernels.py --headdims 64 128 --seqlens 1024 4096 16384 \
  --backends cute sdpa_cudnn sdpa_flash flash_attn_4 --deterministic --accumulate --accumulate-seqlens 4096 \
  --warmup-ms 10 --rep-ms 40 --out-dir "$OUT"
TAIL_LINES=25 stage tests 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_backends_gpu.py tests/cp/test_cp_gpu.py
TAIL_LINES=30 stage cp_sim 50 python3 bench/cp_sim.py --reps 2
TAIL_LINES=15 stage fsdp2 100 torchrun --nproc-per-node 1 recipes/fsdp2_train.py --model base --seqlen 32768 \
  --batch-size 1 --packing stream --steps 6 --timing-warmup 2 --dtype bf16 --activation-checkpointing --metrics-out "$OUT/fsdp2.jsonl"
