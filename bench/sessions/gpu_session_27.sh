#!/usr/bin/env bash
# Prepared in the twenty-sixth session (2026-12-03), results in bench/results/2026-12-03-twenty-sixth-*:
#   source .devwheels/install.sh && bash bench/sessions/gpu_session_27.sh 1
# 1: a ring member's backward zero-filled its fp32 dK / dV buffers before adding into them: its own rows once and
#    every received step's partial (at cp = 8 and 128k tokens, 16 heads of 128: 7 x 256 MiB + 2 x 128 MiB, ~0.6 ms
#    of a ~37 ms member backward; at cp = 2 with a 4096-token window ~0.4 ms of ~11 ms). The work-list backward now
#    takes fresh_dkv: each key row's first launch writes its dK / dV (0 + x, the zero-filled run's bits), later
#    ones add, only rows no item has are zeroed. Prediction: cp = 8 causal backward +1-1.5% (0.936 -> ~0.95),
#    windowed cp = 2 +3% (0.898 -> ~0.92), bwd_zero_fill (the old way, same run) where the previous session read.
#    First the bits: fresh_dkv over NaN-poisoned buffers against the zero-filled run (bytes), then the twenty-fifth
#    session's accumulating-convert selection, which its stage limit cut short.
set -u
source "$(dirname "$0")/../stage.sh"
export FA4DIST_CUTE_COMPILE_LOG=$OUT/compiled.txt
bundle_folders_on_exit
if [ "${1:-1}" = 1 ]; then
  TAIL_LINES=8 stage tests_fresh_dkv 190 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_worklist_gpu.py -k "fresh_dkv"
  TAIL_LINES=30 stage cp_sim_fresh 130 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions bwd bwd_zero_fill --reps 4 --queue-ahead-ms 8 --back-to-back --tag fresh
  TAIL_LINES=30 stage cp_sim_fresh_window 70 python3 bench/cp_sim.py --seqlens 131072 --cp 2 --balancers lpt \
    --directions bwd bwd_zero_fill --reps 4 --queue-ahead-ms 8 --back-to-back --window 4096 --tag fresh-window
  TAIL_LINES=8 stage tests_convert 190 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/kernels/test_cute_bwd_gpu.py tests/kernels/test_worklist_gpu.py tests/cp/test_cp_gpu.py \
    -k "accumulate or fixed_point or shared_queries or packed_per_segment or one_gradient or fp32_out or backward_ring or invariant"
  exit
fi
# 2: call 1 (fresh dK / dV) read cp = 8 causal backward 0.952 against 0.933 zero-filled in the same run, and the
#    windowed cp = 2 backward 0.941 against 0.886. A member's forward also filled every row of its fp32 out and lse
#    before its first step, whose fresh call writes the rows it covers: now only the rows the first step misses
#    are filled (Accumulators.empty(first_items)). Prediction: windowed cp = 2 forward +3% (0.898 -> ~0.93: the
#    fills were 0.116 of 3.51 ms), cp = 8 within noise (0.04 of 14 ms). Both directions in one run, to read the
#    windowed cp = 2 forward+backward against one GPU (#15: >= 1.8x); then the ring's GPU tests on the new buffers.
if [ "$1" = 2 ]; then
  TAIL_LINES=40 stage cp_sim_window_all 170 python3 bench/cp_sim.py --seqlens 131072 --cp 2 --balancers lpt \
    --directions fwd fwd_zero_fill bwd bwd_zero_fill --reps 6 --queue-ahead-ms 8 --back-to-back --window 4096 \
    --tag window-all
  TAIL_LINES=40 stage cp_sim_causal_all 200 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd fwd_zero_fill bwd --reps 6 --queue-ahead-ms 8 --back-to-back --tag causal-all
  TAIL_LINES=8 stage tests_cp 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/cp/test_cp_gpu.py tests/kernels/test_worklist_gpu.py -k "ring or invariant or shared or fresh"
  exit
fi
# 3: the forward at cp = 8 (0.905) trails its per-item plain calls (the "kernel" column, 0.99), which run on the
#    persistent grid, while the work-list merges run one CTA per tile: 2048 equal tiles of a step on 132 SMs leave
#    the last of ~15.5 waves half idle (~3% a launch). Merges on the persistent grid measured no faster in the
#    eleventh session's one-by-one timing (+1-3%, within that noise); back to back they are read again, as a
#    knob (FA4DIST_FWD_OVERRIDE, not the default: its merge rounds may differ by an ulp from the per-item calls'
#    unless exact_merge). Prediction: within +-1% (the persistent grid walks the same tiles; the tail stays unless
#    the claims interleave tiles of different lengths). Then the ring's GPU tests after the Schedule rewrite and
#    the aligned plans' new balance.
if [ "$1" = 3 ]; then
  TAIL_LINES=6 stage cp_sim_fwd_default 90 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd --reps 6 --queue-ahead-ms 8 --back-to-back --tag fwd-default
  FA4DIST_FWD_OVERRIDE=persistent_ctas=132 TAIL_LINES=6 stage cp_sim_fwd_persistent 120 python3 bench/cp_sim.py \
    --seqlens 131072 --cp 8 --balancers lpt --directions fwd --reps 6 --queue-ahead-ms 8 --back-to-back \
    --tag fwd-persistent
  TAIL_LINES=8 stage tests_cp_plans 200 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -m gpu \
    tests/cp/test_cp_gpu.py tests/kernels/test_worklist_gpu.py -k "ring or invariant or packed"
  exit
fi
# 4: the table's other rows with the fresh buffers: cp = 4 causal (0.944 / 0.947 in the twenty-fifth session) and
#    cp = 8 with a 4096-token window (0.80 / 0.74 then: each member runs 2 of 8 steps, calls of 1-3 ms).
#    Prediction: cp = 4 backward ~0.96 (+1.5%), forward unchanged; windowed cp = 8 backward +5-8% (its fills were a
#    larger share of its short calls).
if [ "$1" = 4 ]; then
  TAIL_LINES=4 stage cp_sim_cp4 90 python3 bench/cp_sim.py --seqlens 131072 --cp 4 --balancers lpt \
    --directions fwd bwd --reps 4 --queue-ahead-ms 8 --back-to-back --tag cp4
  TAIL_LINES=4 stage cp_sim_window_cp8 70 python3 bench/cp_sim.py --seqlens 131072 --cp 8 --balancers lpt \
    --directions fwd bwd bwd_zero_fill --reps 4 --queue-ahead-ms 8 --back-to-back --window 4096 --tag window-cp8
  exit
fi
# 5 (prepared, never run): paired remote steps (cp_sim --directions fwd_pairs) became the ring forward's launch
#    groups in the twenty-seventh session; bench/sessions/gpu_session_28.sh 1 measures them.
