#!/usr/bin/env bash
# Fifty-third session (2026-12-06). The two-GPU kind is still not lent.
# Ran (calls 1-2, an H100 came for nvidia-h200): gpu_session_52.sh peer_chunks and peer_cp on the peer-chunks
# branch, all green; merged. Its transport bench: 256 MiB in 1.97 ms against 0.83-1.07 ms with the unchunked slots.
# - chunks: why. Guess: two processes share this one GPU without MPS, so each chunk's handoff (sender's copy, then
#   the receiver's) is a switch between the two processes' GPU contexts; 8 chunks of 32 MiB make 16 switches where
#   the unchunked slots made 2. Predicted: 256 MiB chunks give ~1 ms again, 8 MiB chunks ~4-5 ms (a cost per chunk,
#   ~60-120 us), and 1 MiB / 64 MiB (one or two chunks at 32 and 256) alike. Between two GPUs no context switches.
# Ran (call 3): chunks; as predicted in kind, ~105 us a chunk at 32 MiB and ~155 at 8 (bench/RESULTS.md).
# - sanitizer: how much of #15's window gap (0.98-0.99x flash-attn-4 at 32k, W 4096) is the sanitizer's scan of
#   the masked blocks' K / V (a windowed query tile has two masked key blocks of ~33, a causal one one of ~128).
#   bench/window.py --cases causal window, the defaults, then FA4DIST_FWD/BWD_OVERRIDE=sanitize=0 (the measurement
#   knob that drops the masked-NaN guarantee), each run beside flash-attn-4. Predicted: sanitize=0 +1-2% on the
#   window rows, ~0 on causal; if so, a clean-tile skip for the forward (as the backward's clean_tiles) is the lead.
# Ran (call 6): sanitizer; +1.0% fwd / +1.2% fwd+bwd on the window rows without it (bench/RESULTS.md).
# - table: the #11 points at S >= 4k with device time and five interleaved rounds (the fifty-second session's do_bench
#   table read hdim 128 non-causal 16k forward 0.94x flash-attn-4 where the forty-third's device time read 0.99).
#   Predicted: forward 0.97-1.01 at every point, the 0.94 a do_bench reading.
# Ran (call 7): table; forward 0.98-1.04x flash-attn-4 (bench/RESULTS.md).
# - masked_last: the forward's plain key blocks first and its masked ones (causal band, window edge) last
#   (FwdConfig.masked_last, a knob, off by default: other bits), so that the sanitizer scans a masked V tile while
#   plain blocks compute instead of before the tile's first PV (the lead of the twenty-ninth and forty-fifth
#   sessions). First the forward's GPU tests under FA4DIST_FWD_OVERRIDE=masked_last=1 (NaN / inf in masked V,
#   windows, packed, accumulate), then bench/window.py with and without it and the 1k causal forward beside
#   cuDNN and flash-attn-4. Predicted: the window rows +0.5-1% (about half of sanitize=0's +1.0%), causal 1k
#   +1-2% (the scan's latency before the first PV, forty-fifth session), 4k-16k causal within noise.
# Ran (call 9, masked_last_quick: the tests and the window rows in the last device time): 12 passed; window
#   forward -1.0% (wrong in sign). Next: the `masked_last` part's short_causal stage (causal 1k and 4k, hdim 128
#   and 64, beside cuDNN and flash-attn-4); drop the knob if it loses there too.
# Calls: source .devwheels/install.sh && bash bench/sessions/gpu_session_53.sh chunks | sanitizer | table | masked_last
set -u
source "$(dirname "$0")/../stage.sh"
for s in ${*:-chunks}; do
  case $s in
    chunks)
      for c in 32 256 8; do
        TAIL_LINES=5 stage "transport_chunk$c" 90 python3 -m torch.distributed.run --nproc-per-node 2 \
          bench/transport.py --chunk-mib "$c" --out-dir "$OUT"
      done ;;
    sanitizer)
      export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s53
      TAIL_LINES=10 stage window_default 240 python3 bench/window.py --cases causal window --rounds 5 \
        --queue-ahead-ms 5 --out-dir "$OUT/default"
      TAIL_LINES=10 stage window_nosanitize 240 env FA4DIST_FWD_OVERRIDE=sanitize=0 FA4DIST_BWD_OVERRIDE=sanitize=0 \
        python3 bench/window.py --cases causal window --rounds 5 --queue-ahead-ms 5 --out-dir "$OUT/nosanitize" ;;
    table)
      export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s53
      kernels_table ;;
    masked_last)
      export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s53
      TAIL_LINES=8 stage masked_last_tests 170 env FA4DIST_FWD_OVERRIDE=masked_last=1 python3 -m pytest -x -q \
        -p no:cacheprovider -rfE tests/kernels/test_cute_nonfinite_gpu.py tests/kernels/test_window_gpu.py \
        tests/kernels/test_cute_fwd_gpu.py -k "forward_dense or forward_packed or fp16 or lse_is or rows_that or \
garbage or between or dense_windows or packed_windows or test_dense or test_varlen or test_accumulate"
      TAIL_LINES=6 stage window_base 90 python3 bench/window.py --cases causal window --rounds 5 \
        --queue-ahead-ms 5 --out-dir "$OUT/window_base"
      TAIL_LINES=6 stage window_masked_last 90 env FA4DIST_FWD_OVERRIDE=masked_last=1 python3 bench/window.py \
        --cases causal window --rounds 5 --queue-ahead-ms 5 --out-dir "$OUT/window_masked_last"
      TAIL_LINES=14 stage short_causal 100 python3 bench/kernels.py --headdims 128 64 --seqlens 1024 4096 \
        --causal true --directions fwd --backends cute cudnn flash_attn_4 --cute-variants fwd:masked_last=1 \
        --rounds 5 --queue-ahead-ms 3 --out-dir "$OUT/short_causal" ;;
    masked_last_quick)  # (the session's last 260 s of device time: the NaN / window tests and the window rows)
      export FA4DIST_CUTE_AOT_DIR=$PWD/.aot/s53
      TAIL_LINES=8 stage masked_last_tests 80 env FA4DIST_FWD_OVERRIDE=masked_last=1 python3 -m pytest -x -q \
        -p no:cacheprovider -rfE tests/kernels/test_cute_nonfinite_gpu.py tests/kernels/test_window_gpu.py \
        -k "forward_dense or forward_packed or garbage or between"
      TAIL_LINES=6 stage window_base 60 python3 bench/window.py --cases causal window --rounds 5 \
        --queue-ahead-ms 5 --out-dir "$OUT/window_base"
      TAIL_LINES=6 stage window_masked_last 60 env FA4DIST_FWD_OVERRIDE=masked_last=1 python3 bench/window.py \
        --cases causal window --rounds 5 --queue-ahead-ms 5 --out-dir "$OUT/window_masked_last" ;;
    *) echo "unknown stage $s (chunks | sanitizer | table | masked_last | masked_last_quick)"; exit 2 ;;
  esac
done
