#!/usr/bin/env bash
# Fifty-second session (2026-12-06). The two-GPU kind is still not lent.
# - probe (run in call 1; its script, bench/peer_probe.py, removed after it): bench/p2p.py measured torch's
#   symmetric-memory peer copies at 1.5-1.7x NCCL's send/recv between the two H200s, with half NCCL's slowdown of a
#   concurrent matmul, but no transport used them. Before building one: what symmetric memory does for two
#   processes on this one GPU under gloo (the staged-rank layout the GPU tests use). Predicted: it works.
# - table (#11): the kernels table on today's defaults (last on an H200 in the forty-fifth session, before
#   reset_counter became the default).
# Ran (call 1, an H100 came for nvidia-h200): probe, table. torch's symmetric memory refuses two ranks on one GPU
# ("detected allocations from overlapping devices from different ranks"), so the transport is built on CUDA IPC and
# the driver's stream memory operations instead (fa4dist/context_parallel/peer.py), which work for any number of
# processes per GPU.
# - peer: its GPU tests (tests/cp/test_peer_gpu.py: fp64 exactness, the group transport's bytes, random batches
#   through slot growth, the watchdog's abort), then the staged-rank CP suite under FA4DIST_CP_TRANSPORT=peer.
#   Predicted: all pass (the transport moves bytes only).
# - transport: bench/transport.py, the group's transport against the peer copies through Transport itself.
# Ran: table, peer, peer_cp, transport, peer_quick (bench/RESULTS.md, fifty-second session). Next: on branch
# peer-chunks its `peer_chunks` stage (the chunked slots, not yet run on a GPU), then merge; on two GPUs,
# gpu_session_x2.sh transport (NCCL against the peer copies) before `cp`.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_52.sh table | peer | peer_cp | transport
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s52 FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
for s in ${*:-peer}; do
  case $s in
    table)
      TAIL_LINES=30 stage table 240 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 16384 \
        --causal false true --directions fwd bwd --deterministic --backends cute cudnn flash_attn_4 --rounds 3 \
        --out-dir "$OUT/table" ;;
    peer)
      TAIL_LINES=25 stage peer_tests 300 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_peer_gpu.py ;;
    peer_cp)
      TAIL_LINES=25 stage peer_cp_tests 400 env FA4DIST_CP_TRANSPORT=peer python3 -m pytest -x -q -p no:cacheprovider \
        -rfE tests/cp/test_cp_gpu.py ;;
    peer_quick)  # (after call 6: the capture refusal; the cases that compile no fused kernel)
      TAIL_LINES=12 stage peer_quick 200 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_peer_gpu.py \
        -k "capture or fp64 or whole or answers" ;;
    peer_chunks)  # (after call 7: 32 MiB chunks through two fixed slots per pair, send and receive streams apart)
      TAIL_LINES=8 stage peer_quick 120 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_peer_gpu.py \
        -k "capture or fp64 or whole or answers"
      TAIL_LINES=6 stage transport 60 python3 -m torch.distributed.run --nproc-per-node 2 bench/transport.py \
        --out-dir "$OUT"
      TAIL_LINES=8 stage peer_bytes 240 python3 -m pytest -x -q -p no:cacheprovider -rfE tests/cp/test_peer_gpu.py \
        -k "bytes" ;;
    transport)
      TAIL_LINES=6 stage transport 120 python3 -m torch.distributed.run --nproc-per-node 2 bench/transport.py \
        --out-dir "$OUT" ;;
    *) echo "unknown stage $s (table | peer | peer_quick | peer_chunks | peer_cp | transport)"; exit 2 ;;
  esac
done
