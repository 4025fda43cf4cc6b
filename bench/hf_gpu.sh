#!/usr/bin/env bash
# The Hugging Face integration on GPUs (recipes/hf_sft.py, bench/hf_context_search.py), in time-limited stages.
#   source .devwheels/install.sh && bash bench/hf_gpu.sh one   # one GPU: hf_sft.py at 32k          (<= 90 s)
#   source .devwheels/install.sh && bash bench/hf_gpu.sh two   # two GPUs: cp=2 at 64k, then the largest
#                                                              # Llama-3-8B-shaped context at cp=2   (<= 4 min)
# Logs, metrics (JSON lines) and the search's tries go to $OUT; a table of the results is printed last.
# HF_GPU_TINY=1 shrinks every size (tiny model, short contexts, CPU/gloo works) to test the script's logic.
# HF_GPU_OFFLOAD=1 adds a second search with the activation checkpoints offloaded to host memory (+~2 min).
set -u
MODE=${1:-}
source "$(dirname "$0")/stage.sh"

if [ "${HF_GPU_TINY:-0}" = 1 ]; then
  SMALL=tiny; BIG=tiny; S1=512; S2=1024; DTYPE=auto; STEPS=3; WARM=1
  SEARCH=(--seqlens 512 1024 --granularity 512 --max-tries 3 --memory-gib 1 --tile-mlp 256 --loss-chunk 128)
  LIMIT_ONE=120; LIMIT_CP=120; LIMIT_SEARCH=150; BUDGET=100
else
  SMALL=base; BIG=llama3-8b; S1=32768; S2=65536; DTYPE=bf16; STEPS=5; WARM=2
  SEARCH=(--seqlens 131072 262144 --granularity 32768 --max-tries 5 --tile-mlp 16384)
  LIMIT_ONE=85; LIMIT_CP=75; LIMIT_SEARCH=155; BUDGET=120
fi
COMMON=(--batch-size 1 --dtype "$DTYPE" --activation-checkpointing --timing-warmup "$WARM")

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

TORCHRUN=(python3 -m torch.distributed.run --standalone)  # (timeout runs commands, not shell functions)

case "$MODE" in
  one)
    # The recipes' one-GPU benchmark shape (fa4dist's "base": 378M parameters, one causal 32k sequence), as a
    # transformers LlamaForCausalLM: compare with fsdp2_train.py's run of the same shape in bench/RESULTS.md.
    stage hf_sft_1gpu_32k "$LIMIT_ONE" "${TORCHRUN[@]}" --nproc-per-node 1 recipes/hf_sft.py --model "$SMALL" \
      --seqlen "$S1" --packing stream --steps $((STEPS + 1)) "${COMMON[@]}" --memory-report \
      --metrics-out "$OUT/hf_sft_1gpu_32k.jsonl"
    ;;
  two)
    stage hf_sft_cp2_64k "$LIMIT_CP" "${TORCHRUN[@]}" --nproc-per-node 2 recipes/hf_sft.py --model "$SMALL" \
      --seqlen "$S2" --cp 2 --packing stream --steps "$STEPS" "${COMMON[@]}" --memory-report \
      --metrics-out "$OUT/hf_sft_cp2_64k.jsonl"
    # Llama-3-8B shape, random init, FSDP2 over both GPUs, cp = 2, activation checkpointing, tiled loss and MLP;
    # packed documents (this repository's files), so attention is a small part of a step.
    TAIL_LINES=14 stage hf_search_8b "$LIMIT_SEARCH" "${TORCHRUN[@]}" --nproc-per-node 2 bench/hf_context_search.py \
      --model "$BIG" --cp 2 --packing documents "${COMMON[@]}" "${SEARCH[@]}" --budget-s "$BUDGET" \
      --out "$OUT/hf_search_8b.jsonl"
    if [ "${HF_GPU_OFFLOAD:-0}" = 1 ]; then
      TAIL_LINES=14 stage hf_search_8b_offload "$LIMIT_SEARCH" "${TORCHRUN[@]}" --nproc-per-node 2 \
        bench/hf_context_search.py --model "$BIG" --cp 2 --packing documents "${COMMON[@]}" "${SEARCH[@]}" \
        --offload-checkpoints --budget-s "$BUDGET" --out "$OUT/hf_search_8b_offload.jsonl"
    fi
    ;;
  *)
    echo "usage: bash bench/hf_gpu.sh one|two" >&2
    exit 2
    ;;
esac

# The table: every SUMMARY line and every try of the searches in this $OUT.
python3 - "$OUT" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
rows = []
for log in sorted(out.glob("hf_*.log")):
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("SUMMARY "):
            s = json.loads(line[8:])
            rows.append((log.stem, s["model"], s["world"], s["cp"], s["seqlen"], s.get("tokens_per_s"), s.get("mfu"),
                         s.get("peak_mem_gib"), "ok"))
for path in sorted(out.glob("hf_search*.jsonl")):
    started = {}
    for line in path.read_text().splitlines():
        t = json.loads(line)
        if t.get("status") == "started":
            started[t["seqlen"]] = t
            continue
        started.pop(t["seqlen"], None)
        rows.append((path.stem, t["model"], t["world"], t["cp"], t["seqlen"], t.get("tokens_per_s"), t.get("mfu"),
                     t.get("peak_gib"), "ok" if t["ok"] else "OOM"))
    for t in started.values():  # a try the job did not finish: out of memory on some ranks, or the stage's limit
        rows.append((path.stem, t["model"], t["world"], t["cp"], t["seqlen"], None, None, None, "unfinished"))
print("| stage | model | GPUs | cp | seqlen | tokens/s | MFU | peak GiB | result |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join("-" if v is None else str(v) for v in r) + " |")
PY
