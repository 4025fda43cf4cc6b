#!/usr/bin/env bash
# One call on two H200s (kind nvidia-h200-x2): context parallelism over NCCL and the GPU tests that need a GPU, in
# time-limited stages; logs and JSON go to $OUT.  A session's part is picked by its first argument:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_x2.sh cp      # CP tests + multi-GPU bench + p2p
#     Predicted (fifty-first session: at cp = 2 a rank's kernels take half the whole sequence's in the one-GPU
#     simulation, 32 / 8 heads, 32k and 128k tokens per GPU): ring efficiency 0.97-0.99 where the transfers stay
#     hidden as in the first session's run 2 (0.4 ms exposed); what the profile shows below that is the transfers'.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_x2.sh transport # copy-engine peer copies
#     (FA4DIST_CP_TRANSPORT=peer, fifty-second session; tested on one GPU only) against NCCL: correctness, the
#     transport alone (bench/transport.py), then the ring and Ulysses steps under both. Predicted: the transport at
#     1.4-1.7x NCCL's rate for 64-256 MiB (torch's peer copies read 1.5-1.7x in bench/p2p.py), and the cp = 2 step
#     +0.5-2 points of efficiency where the profile of `cp` shows transfers exposed or NCCL's kernels slowing the
#     attention; nothing where they are hidden already. If it holds, make peer the default on one host. Then 8 and
#     128 MiB chunks against the default 32: predicted within 5% of each other between GPUs (a handoff is a stream
#     wait there, not the context switch of two processes sharing one GPU).
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_x2.sh recipes # HF SFT, FSDP2 at 2 GPUs, cp_sim
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_x2.sh window  # CP with a sliding window in the kernels
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_x2.sh ulysses # Ulysses head chunks (thirty-ninth
#     session): FA4DIST_ULYSSES_CHUNKS 1 / 2 / 4, the exchange of chunk c + 1 under chunk c's attention. Predicted from
#     the one-GPU numbers (32/32 heads, 64k tokens: 0.89 efficiency, ~0.1 of the step in the exposed all-to-alls):
#     +4-8% at 4 chunks, the first exchange and last return (a quarter each) still exposed; less at 32/8, whose K/V
#     are a quarter of Q's bytes. If it pays, make the default follow the measurement.
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_x2.sh forward # the forward alone (no autograd):
#     ring and Ulysses against one GPU, where the ring's per-range sends (forty-sixth session: no pack copy) act.
set -u
PART=${1:-cp}
source "$(dirname "$0")/../stage.sh"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
env | grep -E "^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=" || true
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
case "$PART" in
  cp)
    TAIL_LINES=14 stage multigpu_check 150 "${TORCHRUN[@]}" tests/cp/multigpu_check.py
    TAIL_LINES=24 stage multigpu_bench 200 "${TORCHRUN[@]}" bench/multigpu.py --tokens-per-gpu 32768 131072 \
      --heads 32:8 32:32 --peer --profile --invariant --reps 3 --out-dir "$OUT"
    TAIL_LINES=25 stage gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -rfE \
      tests/kernels/test_nonfinite.py tests/kernels/test_window_gpu.py tests/cp/test_cp_gpu.py
    ;;
  transport)
    TAIL_LINES=14 stage peer_check 150 env FA4DIST_CP_TRANSPORT=peer "${TORCHRUN[@]}" tests/cp/multigpu_check.py
    TAIL_LINES=8 stage transport 120 "${TORCHRUN[@]}" bench/transport.py --mib 1 64 256 --out-dir "$OUT"
    TAIL_LINES=16 stage multigpu_transports 300 "${TORCHRUN[@]}" bench/multigpu.py --tokens-per-gpu 32768 131072 \
      --heads 32:8 32:32 --transports group peer --reps 3 --out-dir "$OUT"
    # last (the call's 600 s may end it): the chunk size between GPUs (on one GPU shared by two processes a chunk
    # cost ~100 us: fifty-third session)
    for c in 8 128; do
      TAIL_LINES=6 stage "transport_chunk$c" 60 "${TORCHRUN[@]}" bench/transport.py --mib 64 256 --chunk-mib "$c" \
        --out-dir "$OUT"
    done
    ;;
  window)
    TAIL_LINES=18 stage multigpu_check 150 "${TORCHRUN[@]}" tests/cp/multigpu_check.py
    TAIL_LINES=8 stage multigpu_window 120 "${TORCHRUN[@]}" bench/multigpu.py --tokens-per-gpu 65536 \
      --heads 32:8 --window 4096 --reps 3 --out-dir "$OUT"
    TAIL_LINES=12 stage multigpu_window_profile 120 "${TORCHRUN[@]}" bench/multigpu.py --tokens-per-gpu 65536 \
      --heads 32:8 --window 4096 --reps 3 --balancer contiguous --strategies ring --profile --out-dir "$OUT/profile"
    TAIL_LINES=10 stage window_tests 150 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_window_gpu.py \
      -k cute
    ;;
  ulysses)
    TAIL_LINES=18 stage multigpu_ulysses_chunks 240 "${TORCHRUN[@]}" bench/multigpu.py --tokens-per-gpu 32768 131072 \
      --heads 32:8 32:32 --strategies ulysses --ulysses-chunks 1 2 4 --reps 3 --out-dir "$OUT"
    TAIL_LINES=10 stage ulysses_chunks_check 150 env FA4DIST_ULYSSES_CHUNKS=4 "${TORCHRUN[@]}" \
      tests/cp/multigpu_check.py
    ;;
  forward)
    TAIL_LINES=10 stage multigpu_check 150 "${TORCHRUN[@]}" tests/cp/multigpu_check.py
    TAIL_LINES=10 stage multigpu_fwd 200 "${TORCHRUN[@]}" bench/multigpu.py --tokens-per-gpu 32768 131072 \
      --heads 32:8 32:32 --strategies ring ulysses --forward-only --reps 5 --out-dir "$OUT/fwd"
    ;;
  recipes)
    # DeepSpeed is not on the GPU image: its wheels (and pydantic's) travel in .dswhl when this part runs.
    if ls .dswhl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dsite .dswhl/*.whl
      export PYTHONPATH="$PYTHONPATH:/tmp/dsite"
    fi
    TAIL_LINES=12 stage hf_two 220 bash bench/hf_gpu.sh two
    RECIPE=(--model base --seqlen 65536 --cp 2 --batch-size 1 --packing stream --steps 6 --timing-warmup 2
            --dtype bf16 --activation-checkpointing)
    TAIL_LINES=3 stage fsdp2_cp2_64k 90 "${TORCHRUN[@]}" recipes/fsdp2_train.py "${RECIPE[@]}"
    TAIL_LINES=3 stage ds_zero3_cp2_64k 110 "${TORCHRUN[@]}" recipes/deepspeed_train.py --zero-stage 3 "${RECIPE[@]}"
    TAIL_LINES=3 stage ds_zero2_cp2_64k 100 "${TORCHRUN[@]}" recipes/deepspeed_train.py --zero-stage 2 "${RECIPE[@]}"
    ;;
esac
